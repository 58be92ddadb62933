// io/image.cpp — heat-map grids and line plots (mha/image.h), drawn with cairo.
//
// Each picture is laid out once (sizes in pixels, text measured in its font) and drawn by one
// routine on a cairo context; the context's surface decides the output: an RGB image surface for
// PNG and for the Image a caller reads pixels from, or an SVG surface. cairo anti-aliases the lines,
// draws text in DejaVu Sans (found through fontconfig) and reads and writes the PNG files.
#include "mha/image.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numbers>

#include "io/paths.h"

namespace mha {

namespace {

// ---- cairo handles, errors, colours, text --------------------------------------------------------

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct ContextDeleter {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using Context = std::unique_ptr<cairo_t, ContextDeleter>;

void check(cairo_status_t status, const char* fn, const std::string& what) {
  if (status != CAIRO_STATUS_SUCCESS) fail(fn, ": ", what, ": ", cairo_status_to_string(status));
}

/// A context whose text measures the same on every surface (unhinted metrics), so a layout
/// computed once fits the PNG and the SVG alike.
Context make_context(cairo_surface_t* surface, const char* fn) {
  Context cr(cairo_create(surface));
  check(cairo_status(cr.get()), fn, "cannot create a drawing context");
  cairo_font_options_t* fo = cairo_font_options_create();
  cairo_font_options_set_hint_metrics(fo, CAIRO_HINT_METRICS_OFF);
  cairo_font_options_set_hint_style(fo, CAIRO_HINT_STYLE_SLIGHT);
  cairo_font_options_set_antialias(fo, CAIRO_ANTIALIAS_GRAY);
  cairo_set_font_options(cr.get(), fo);
  cairo_font_options_destroy(fo);
  return cr;
}

/// A 1×1 surface to measure text on before the picture's size is known.
struct Measurer {
  Surface surface{cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1)};
  Context cr = make_context(surface.get(), "image");
};

void set_color(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r / 255.0, c.g / 255.0, c.b / 255.0); }

/// Pixel-aligned rectangles keep exact colours (cell centres are read back by tests and tools).
void fill_rect(cairo_t* cr, double x, double y, double w, double h, Rgb c) {
  set_color(cr, c);
  cairo_rectangle(cr, x, y, w, h);
  cairo_fill(cr);
}

enum class Weight : uint8_t { Normal, Bold };
enum class Anchor : uint8_t { Start, Middle, End };
enum class Direction : uint8_t { Right, Up };  ///< Up: rotated 90° counter-clockwise, read bottom to top

/// Text sizes (the em square, in pixels) and where a line of text sits around its baseline.
constexpr double kLabelSize = 10, kPanelTitleSize = 12, kTitleSize = 16;
constexpr double kAscent = 0.76, kMidline = 0.36;  ///< cap height and the middle of lowercase, × size

void set_font(cairo_t* cr, double size, Weight weight) {
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                         weight == Weight::Bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& s, double size, Weight weight = Weight::Normal) {
  set_font(cr, size, weight);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

/// Text with its baseline through (x, y), anchored there by its start, middle or end.
void draw_text(cairo_t* cr, double x, double y, const std::string& s, double size, Rgb c, Anchor anchor,
               Direction dir = Direction::Right, Weight weight = Weight::Normal) {
  const double w = text_width(cr, s, size, weight);
  cairo_save(cr);
  cairo_translate(cr, x, y);
  if (dir == Direction::Up) cairo_rotate(cr, -std::numbers::pi / 2);
  cairo_move_to(cr, anchor == Anchor::Start ? 0.0 : anchor == Anchor::Middle ? -w / 2 : -w, 0.0);
  set_color(cr, c);
  cairo_show_text(cr, s.c_str());
  cairo_restore(cr);
}

/// Valid UTF-8 without control characters (cairo refuses invalid UTF-8: bad bytes, overlong forms,
/// surrogates, code points past U+10FFFF); anything else becomes '?'.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = n > 0 && i + n <= s.size();
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1Fu : n == 3 ? c & 0x0Fu : c & 0x07u;
    for (size_t k = 1; ok && k < n; ++k) {
      const auto cont = static_cast<unsigned char>(s[i + k]);
      ok = (cont & 0xC0) == 0x80;
      cp = cp << 6 | (cont & 0x3Fu);
    }
    static constexpr std::array<uint32_t, 5> kMin = {0, 0, 0x80, 0x800, 0x10000};  // shortest form per length
    ok = ok && cp >= kMin[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF) && cp >= 32 && cp != 127;
    out += ok ? s.substr(i, n) : "?";
    i += ok ? n : 1;
  }
  return out;
}

/// Keeps the first max_chars − 1 code points and adds '…' when `s` is longer.
std::string shortened(const std::string& s, size_t max_chars) {
  size_t chars = 0, i = 0, cut = 0;
  for (; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) continue;
    if (++chars == max_chars) cut = i;
    if (chars > max_chars) return s.substr(0, cut) + "\u2026";
  }
  return s;
}

// ---- surfaces to pixels and files ----------------------------------------------------------------

Surface image_surface(int64_t w, int64_t h, const char* fn) {
  // cairo's image surfaces stop at 32767 pixels a side (its fixed-point coordinates): say so, and
  // what to change, rather than cairo's 'invalid value'. (SVG surfaces have no such limit.)
  constexpr int64_t kMaxSide = 32767;
  if (w > kMaxSide || h > kMaxSide)
    fail(fn, ": the picture would be ", w, " x ", h, " pixels, and an image is at most ", kMaxSide,
         " on a side: draw fewer heads or smaller cells (cell_pixels), or write SVG");
  Surface s(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(w), static_cast<int>(h)));
  check(cairo_surface_status(s.get()), fn,
        "cannot create a " + std::to_string(w) + " x " + std::to_string(h) + " image");
  return s;
}

Image to_image(cairo_surface_t* s) {
  cairo_surface_flush(s);
  const int w = cairo_image_surface_get_width(s), h = cairo_image_surface_get_height(s);
  const int stride = cairo_image_surface_get_stride(s);
  const bool alpha = cairo_image_surface_get_format(s) == CAIRO_FORMAT_ARGB32;
  const unsigned char* data = cairo_image_surface_get_data(s);
  Image img(w, h);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint32_t p = 0;
      std::memcpy(&p, data + static_cast<size_t>(y) * stride + 4 * static_cast<size_t>(x), 4);
      const uint32_t a = alpha ? p >> 24 : 255;
      const auto un = [a](uint32_t v) {  // ARGB32 is premultiplied; alpha is then dropped
        return static_cast<uint8_t>(a == 0 ? 0 : std::min<uint32_t>(255, (v * 255 + a / 2) / a));
      };
      img.set(x, y, {un((p >> 16) & 255), un((p >> 8) & 255), un(p & 255)});
    }
  return img;
}

/// Writes through a temporary file beside `path`, renamed into place when complete.
template <class Write>
void write_atomically(const std::string& path, const char* fn, Write write) {
  io::detail::check_path(fn, path);
  // The name is created here, new and not a link (create_temp_beside), before cairo opens it
  // again by name: owner-writable until then (a read-only picture it replaces would have made it
  // unwritable), the replaced file's permissions after.
  std::string tmp;
  ::close(io::detail::create_temp_beside(fn, path, tmp, /*final_mode=*/false));
  std::error_code ec;
  try {
    write(tmp);
  } catch (...) {
    std::filesystem::remove(tmp, ec);
    throw;
  }
  io::detail::take_mode_of(path, tmp);
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    fail(fn, ": cannot rename '", tmp, "' to '", path, "'");
  }
}

void write_surface_png(const std::string& path, cairo_surface_t* s, const char* fn) {
  write_atomically(path, fn, [&](const std::string& tmp) {
    check(cairo_surface_write_to_png(s, tmp.c_str()), fn, "cannot write '" + tmp + "'");
  });
}

/// Draws on an SVG surface of w × h pixels and writes it to `path`.
template <class Draw>
void write_svg(const std::string& path, int64_t w, int64_t h, const char* fn, Draw draw) {
  write_atomically(path, fn, [&](const std::string& tmp) {
    Surface s(cairo_svg_surface_create(tmp.c_str(), static_cast<double>(w), static_cast<double>(h)));
    check(cairo_surface_status(s.get()), fn, "cannot open '" + tmp + "' for writing");
    cairo_svg_surface_set_document_unit(s.get(), CAIRO_SVG_UNIT_PX);
    {
      Context cr = make_context(s.get(), fn);
      draw(cr.get());
      check(cairo_status(cr.get()), fn, "drawing failed");
    }
    cairo_surface_finish(s.get());
    check(cairo_surface_status(s.get()), fn, "cannot write '" + tmp + "'");
  });
}

}  // namespace

Image::Image(int64_t w, int64_t h, Rgb fill) : width(w), height(h) {
  if (w < 0 || h < 0) fail("Image: negative size ", w, " x ", h);
  rgb.resize(static_cast<size_t>(w * h * 3));
  for (size_t i = 0; i < rgb.size(); i += 3) rgb[i] = fill.r, rgb[i + 1] = fill.g, rgb[i + 2] = fill.b;
}

Rgb Image::pixel(int64_t x, int64_t y) const {
  if (x < 0 || y < 0 || x >= width || y >= height)
    fail("Image::pixel: (", x, ", ", y, ") is outside the ", width, " x ", height, " image");
  const size_t i = static_cast<size_t>((y * width + x) * 3);
  return {rgb[i], rgb[i + 1], rgb[i + 2]};
}

void Image::set(int64_t x, int64_t y, Rgb c) {
  if (x < 0 || y < 0 || x >= width || y >= height) return;
  const size_t i = static_cast<size_t>((y * width + x) * 3);
  rgb[i] = c.r, rgb[i + 1] = c.g, rgb[i + 2] = c.b;
}

void write_png(const std::string& path, const Image& image) {
  if (image.width <= 0 || image.height <= 0 || static_cast<int64_t>(image.rgb.size()) != image.width * image.height * 3)
    fail("write_png: ", path, ": image of ", image.width, " x ", image.height, " with ", image.rgb.size(),
         " bytes is empty or inconsistent");
  const Surface s = image_surface(image.width, image.height, "write_png");
  unsigned char* data = cairo_image_surface_get_data(s.get());
  const int stride = cairo_image_surface_get_stride(s.get());
  for (int64_t y = 0; y < image.height; ++y)
    for (int64_t x = 0; x < image.width; ++x) {
      const Rgb c = image.pixel(x, y);
      const uint32_t p = 0xFF000000u | uint32_t{c.r} << 16 | uint32_t{c.g} << 8 | c.b;
      std::memcpy(data + y * stride + 4 * x, &p, 4);
    }
  cairo_surface_mark_dirty(s.get());
  write_surface_png(path, s.get(), "write_png");
}

Image read_png(const std::string& path) {
  io::detail::check_path("read_png", path);
  const Surface s(cairo_image_surface_create_from_png(path.c_str()));
  const cairo_status_t status = cairo_surface_status(s.get());
  if (status == CAIRO_STATUS_FILE_NOT_FOUND) fail("read_png: cannot open '", path, "'");
  check(status, "read_png", path);
  const cairo_format_t f = cairo_image_surface_get_format(s.get());
  if (f != CAIRO_FORMAT_RGB24 && f != CAIRO_FORMAT_ARGB32) {  // other PNG kinds: convert by drawing
    const Surface rgb =
        image_surface(cairo_image_surface_get_width(s.get()), cairo_image_surface_get_height(s.get()), "read_png");
    const Context cr = make_context(rgb.get(), "read_png");
    cairo_set_source_surface(cr.get(), s.get(), 0, 0);
    cairo_paint(cr.get());
    return to_image(rgb.get());
  }
  return to_image(s.get());
}

Rgb heat_color(double t) {
  // Dark purple → red → orange → light yellow: ordered by lightness, so it reads in grey too.
  static constexpr std::array<std::array<double, 3>, 5> kStops = {
      {{0, 0, 4}, {87, 16, 110}, {188, 55, 84}, {249, 142, 9}, {252, 255, 164}}};
  if (!(t > 0)) t = 0;  // NaN → 0
  if (t > 1) t = 1;
  const double pos = t * static_cast<double>(kStops.size() - 1);
  const auto i = std::min<size_t>(static_cast<size_t>(pos), kStops.size() - 2);
  const double f = pos - static_cast<double>(i);
  const auto mix = [&](size_t ch) {
    return static_cast<uint8_t>(std::lround(kStops[i][ch] + f * (kStops[i + 1][ch] - kStops[i][ch])));
  };
  return {mix(0), mix(1), mix(2)};
}

Rgb masked_color() { return {214, 214, 214}; }

// ---- heat-map grid -------------------------------------------------------------------------------

namespace {

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kAxisGrey{90, 90, 90}, kGridGrey{228, 228, 228};
constexpr int64_t kMargin = 12, kGap = 20, kPanelTitleH = 18;
constexpr int64_t kBarW = 16;

int64_t ceil_px(double v) { return static_cast<int64_t>(std::ceil(v)); }

struct GridGeometry {
  int64_t H = 0, Tq = 0, Tk = 0, cell = 0, cols = 0, rows = 0;
  int64_t left = 0, bottom = 0;      ///< label space left of / below each matrix
  int64_t panel_w = 0, panel_h = 0;  ///< including labels and title
  int64_t top = 0;                   ///< y of the first panel row
  int64_t bar_x = 0, bar_h = 0;      ///< colour scale bar
  int64_t width = 0, height = 0;
  int64_t label_step = 1;  ///< label every label_step-th row and column
  std::string title;
  std::vector<std::string> qlabels, klabels, titles;
  HeatmapPlacement cells;
};

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

GridGeometry plan_grid(const Tensor& weights, const HeatmapOptions& o, const char* fn) {
  if (weights.dim() != 2 && weights.dim() != 3)
    fail(fn, ": weights must be (h, T_q, T_k) or (T_q, T_k), got ", shape_str(weights.shape()));
  GridGeometry g;
  g.H = weights.dim() == 3 ? weights.size(0) : 1;
  g.Tq = weights.size(-2), g.Tk = weights.size(-1);
  if (g.H < 1 || g.Tq < 1 || g.Tk < 1) fail(fn, ": nothing to draw in weights ", shape_str(weights.shape()));
  if (g.H > 1024 || g.Tq > 4096 || g.Tk > 4096)
    fail(fn, ": weights ", shape_str(weights.shape()),
         " are too large to draw (at most 1024 heads of 4096 x 4096, and a PNG at most 32767 pixels on a side)");
  if (!o.query_labels.empty() && static_cast<int64_t>(o.query_labels.size()) != g.Tq)
    fail(fn, ": ", o.query_labels.size(), " query labels for T_q = ", g.Tq);
  if (!o.key_labels.empty() && static_cast<int64_t>(o.key_labels.size()) != g.Tk)
    fail(fn, ": ", o.key_labels.size(), " key labels for T_k = ", g.Tk);
  if (!o.panel_titles.empty() && static_cast<int64_t>(o.panel_titles.size()) != g.H)
    fail(fn, ": ", o.panel_titles.size(), " panel titles for ", g.H, " heads");
  if (!(o.vmax > 0) || !std::isfinite(o.vmax)) fail(fn, ": vmax must be a positive number, got ", o.vmax);
  if (o.cell_pixels < 0 || o.cell_pixels > 64) fail(fn, ": cell_pixels must be 0 (auto) .. 64, got ", o.cell_pixels);
  if (o.columns < 0) fail(fn, ": columns must be ≥ 0, got ", o.columns);

  const int64_t T = std::max(g.Tq, g.Tk);
  g.cell = o.cell_pixels > 0 ? o.cell_pixels : std::clamp<int64_t>(240 / T, 3, 28);
  g.cols = o.columns > 0 ? std::min(o.columns, g.H)
                         : static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(g.H)) - 1e-9));
  g.rows = (g.H + g.cols - 1) / g.cols;
  g.title = printable(o.title);
  for (int64_t i = 0; i < g.Tq; ++i)
    g.qlabels.push_back(
        shortened(printable(o.query_labels.empty() ? std::to_string(i) : o.query_labels[static_cast<size_t>(i)]), 12));
  for (int64_t j = 0; j < g.Tk; ++j)
    g.klabels.push_back(
        shortened(printable(o.key_labels.empty() ? std::to_string(j) : o.key_labels[static_cast<size_t>(j)]), 12));
  for (int64_t h = 0; h < g.H; ++h)
    g.titles.push_back(
        printable(o.panel_titles.empty() ? "head " + std::to_string(h) : o.panel_titles[static_cast<size_t>(h)]));
  // A label needs its line height of axis; with smaller cells only every k-th position is labelled.
  g.label_step = (ceil_px(kLabelSize * 1.15) + g.cell - 1) / g.cell;

  Measurer m;
  double qmax = 0, kmax = 0, tmax = 0;
  for (const auto& s : g.qlabels) qmax = std::max(qmax, text_width(m.cr.get(), s, kLabelSize));
  for (const auto& s : g.klabels) kmax = std::max(kmax, text_width(m.cr.get(), s, kLabelSize));
  for (const auto& s : g.titles) tmax = std::max(tmax, text_width(m.cr.get(), s, kPanelTitleSize));
  g.left = ceil_px(qmax) + 6;
  g.bottom = ceil_px(kmax) + 6;
  g.panel_w = std::max(g.left + g.Tk * g.cell, ceil_px(tmax)) + kGap;
  g.panel_h = kPanelTitleH + g.Tq * g.cell + g.bottom + kGap;
  g.top = kMargin + (g.title.empty() ? 0 : ceil_px(kTitleSize * 1.25) + 8);
  g.bar_x = kMargin + g.cols * g.panel_w;
  g.bar_h = std::clamp<int64_t>(g.Tq * g.cell, 100, 260);
  const double tick_w = text_width(m.cr.get(), fixed2(o.vmax), kLabelSize);
  const int64_t bar_w = kBarW + 6 + ceil_px(tick_w);
  const int64_t legend_w = 10 + 4 + ceil_px(text_width(m.cr.get(), "masked", kLabelSize));
  const int64_t header_w = ceil_px(text_width(m.cr.get(), "weight", kLabelSize));
  const int64_t title_w = ceil_px(text_width(m.cr.get(), g.title, kTitleSize, Weight::Bold));
  g.width = std::max(g.bar_x + std::max({bar_w, legend_w, header_w}) + kMargin, kMargin + title_w + kMargin);
  g.height = std::max(g.top + g.rows * g.panel_h, g.top + kPanelTitleH + g.bar_h + 40) + kMargin;
  g.cells.cell = g.cell;
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t px = kMargin + (h % g.cols) * g.panel_w, py = g.top + (h / g.cols) * g.panel_h;
    g.cells.panel_x.push_back(px + g.left);
    g.cells.panel_y.push_back(py + kPanelTitleH);
  }
  return g;
}

void draw_heatmap_grid(cairo_t* cr, const Tensor& weights, const HeatmapOptions& o, const GridGeometry& g) {
  fill_rect(cr, 0, 0, static_cast<double>(g.width), static_cast<double>(g.height), kWhite);
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  if (!g.title.empty())
    draw_text(cr, kMargin, kMargin + kTitleSize * kAscent, g.title, kTitleSize, kBlack, Anchor::Start, Direction::Right,
              Weight::Bold);
  const float* w = weights.data();
  const double cell = d(g.cell);
  for (int64_t h = 0; h < g.H; ++h) {
    const double mx = d(g.cells.panel_x[static_cast<size_t>(h)]), my = d(g.cells.panel_y[static_cast<size_t>(h)]);
    draw_text(cr, mx - d(g.left), my - 6, g.titles[static_cast<size_t>(h)], kPanelTitleSize, kBlack, Anchor::Start);
    for (int64_t i = 0; i < g.Tq; ++i) {
      const float* row = w + (h * g.Tq + i) * g.Tk;
      for (int64_t j = 0; j < g.Tk; ++j) {
        // An exact 0 is a masked key (or a fully masked row): drawn off the colour scale.
        const Rgb c = row[j] == 0.0f ? masked_color() : heat_color(static_cast<double>(row[j]) / o.vmax);
        fill_rect(cr, mx + d(j) * cell, my + d(i) * cell, cell, cell, c);
      }
    }
    // Axis labels: queries down the left, keys along the bottom (reading upwards), each centred
    // on its row or column.
    for (int64_t i = 0; i < g.Tq; i += g.label_step)
      draw_text(cr, mx - 4, my + (d(i) + 0.5) * cell + kLabelSize * kMidline, g.qlabels[static_cast<size_t>(i)],
                kLabelSize, kAxisGrey, Anchor::End);
    for (int64_t j = 0; j < g.Tk; j += g.label_step)
      draw_text(cr, mx + (d(j) + 0.5) * cell + kLabelSize * kMidline, my + d(g.Tq) * cell + 4,
                g.klabels[static_cast<size_t>(j)], kLabelSize, kAxisGrey, Anchor::End, Direction::Up);
  }
  // Colour scale: vmax at the top, 0 at the bottom (the same stops as heat_color), then the
  // masked swatch.
  const double bx = d(g.bar_x), by = d(g.top + kPanelTitleH), bh = d(g.bar_h);
  draw_text(cr, bx, by - 6, "weight", kLabelSize, kBlack, Anchor::Start);
  cairo_pattern_t* scale = cairo_pattern_create_linear(0, by + bh, 0, by);
  for (int s = 0; s <= 4; ++s) {
    const Rgb c = heat_color(s / 4.0);
    cairo_pattern_add_color_stop_rgb(scale, s / 4.0, c.r / 255.0, c.g / 255.0, c.b / 255.0);
  }
  cairo_rectangle(cr, bx, by, kBarW, bh);
  cairo_set_source(cr, scale);
  cairo_fill(cr);
  cairo_pattern_destroy(scale);
  for (int tick = 0; tick <= 4; ++tick) {
    const double y = by + std::round((bh - 1) * tick / 4.0);
    fill_rect(cr, bx + kBarW, y, 4, 1, kBlack);
    draw_text(cr, bx + kBarW + 6, y + 0.5 + kLabelSize * kMidline, fixed2(o.vmax * (4 - tick) / 4.0), kLabelSize,
              kBlack, Anchor::Start);
  }
  const double ly = by + bh + 14;
  fill_rect(cr, bx, ly, 10, 10, masked_color());
  draw_text(cr, bx + 14, ly + 5 + kLabelSize * kMidline, "masked", kLabelSize, kBlack, Anchor::Start);
}

Surface render_grid_surface(const Tensor& weights, const HeatmapOptions& options, const char* fn) {
  const GridGeometry g = plan_grid(weights, options, fn);
  Surface s = image_surface(g.width, g.height, fn);
  const Context cr = make_context(s.get(), fn);
  draw_heatmap_grid(cr.get(), weights, options, g);
  check(cairo_status(cr.get()), fn, "drawing failed");
  return s;
}

}  // namespace

HeatmapPlacement heatmap_placement(const Tensor& weights, const HeatmapOptions& options) {
  return plan_grid(weights, options, "heatmap_placement").cells;
}

Image render_heatmap_grid(const Tensor& weights, const HeatmapOptions& options) {
  return to_image(render_grid_surface(weights, options, "render_heatmap_grid").get());
}

void write_heatmap_png(const std::string& path, const Tensor& weights, const HeatmapOptions& options) {
  write_surface_png(path, render_grid_surface(weights, options, "write_heatmap_png").get(), "write_heatmap_png");
}

void write_heatmap_svg(const std::string& path, const Tensor& weights, const HeatmapOptions& options) {
  const GridGeometry g = plan_grid(weights, options, "write_heatmap_svg");
  write_svg(path, g.width, g.height, "write_heatmap_svg",
            [&](cairo_t* cr) { draw_heatmap_grid(cr, weights, options, g); });
}

// ---- line plot -----------------------------------------------------------------------------------

namespace {

constexpr std::array<Rgb, 8> kPalette = {{{31, 119, 180},
                                          {230, 110, 10},
                                          {44, 160, 44},
                                          {214, 39, 40},
                                          {148, 103, 189},
                                          {140, 86, 75},
                                          {227, 119, 194},
                                          {100, 100, 100}}};

constexpr double kAxisLabelSize = 11;

/// Tick positions (in data units) for [lo, hi]: 1/2/5 × 10^k steps, or powers of ten on a log axis.
std::vector<double> ticks_for(double lo, double hi, bool log_axis) {
  std::vector<double> t;
  if (log_axis) {
    for (double e = std::floor(std::log10(lo)); e <= std::ceil(std::log10(hi)); ++e) {
      const double v = std::pow(10.0, e);
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) t.push_back(v);
    }
    if (t.size() >= 2) return t;
    t.clear();  // less than a decade: linear ticks over the same range
  }
  const double raw = (hi - lo) / 5.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step)
    t.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return t;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  double map(double v, double p0, double p1) const {  // data → pixel
    const double a = log ? std::log10(v) : v, l = log ? std::log10(lo) : lo, h = log ? std::log10(hi) : hi;
    return p0 + (a - l) / (h - l) * (p1 - p0);
  }
};

Axis make_axis(const std::vector<Series>& series, bool x, bool log_axis, const char* fn) {
  Axis ax;
  ax.log = log_axis;
  double lo = INFINITY, hi = -INFINITY;
  for (const Series& s : series)
    for (double v : x ? s.xs : s.ys) {
      if (!std::isfinite(v)) continue;
      if (log_axis && v <= 0)
        fail(fn, ": series '", s.name, "' has ", x ? "x" : "y", " = ", v,
             " on a logarithmic axis (values must be > 0)");
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
  if (!std::isfinite(lo)) lo = log_axis ? 1 : 0, hi = log_axis ? 10 : 1;  // no finite point at all
  if (hi == lo) {
    if (log_axis)
      lo /= 2, hi *= 2;
    else
      lo -= lo == 0 ? 1 : std::fabs(lo) * 0.1, hi += hi == 0 ? 1 : std::fabs(hi) * 0.1;
  } else if (!log_axis && !x) {  // a little headroom above and below the curves
    const double pad = (hi - lo) * 0.05;
    lo -= pad, hi += pad;
  }
  ax.lo = lo, ax.hi = hi;
  return ax;
}

void check_plot(const std::vector<Series>& series, const LinePlotOptions& o, const char* fn) {
  if (o.width < 100 || o.height < 100 || o.width > 8192 || o.height > 8192)
    fail(fn, ": plot size ", o.width, " x ", o.height, " must be within 100 .. 8192 pixels");
  for (const Series& s : series)
    if (s.xs.size() != s.ys.size())
      fail(fn, ": series '", s.name, "' has ", s.xs.size(), " x values and ", s.ys.size(), " y values");
}

void draw_line_plot(cairo_t* cr, const std::string& raw_title, const std::string& x_label, const std::string& y_label,
                    const std::vector<Series>& series, const LinePlotOptions& o, const char* fn) {
  const double W = static_cast<double>(o.width), H = static_cast<double>(o.height);
  const std::string title = printable(raw_title);
  const Axis ax = make_axis(series, true, o.log_x, fn), ay = make_axis(series, false, o.log_y, fn);
  const std::vector<double> xt = ticks_for(ax.lo, ax.hi, ax.log), yt = ticks_for(ay.lo, ay.hi, ay.log);
  double ylab = 0;
  for (double v : yt) ylab = std::max(ylab, text_width(cr, tick_label(v), kLabelSize));
  // The plot area [x0, x1] × [y0, y1]: left of it the y label and tick labels, below it the tick
  // labels and the x label, above it the title.
  const double x0 = std::round(kMargin + kAxisLabelSize * 1.2 + 6 + ylab + 8), x1 = W - kMargin - 10;
  const double y0 = kMargin + (title.empty() ? 4 : std::round(kTitleSize * 1.25) + 10);
  const double y1 = std::round(H - kMargin - kAxisLabelSize * 1.2 - 6 - kLabelSize * 1.2 - 6);
  if (x1 - x0 < 40 || y1 - y0 < 40) fail(fn, ": a ", o.width, " x ", o.height, " plot is too small to draw");
  fill_rect(cr, 0, 0, W, H, kWhite);
  if (!title.empty())
    draw_text(cr, W / 2, kMargin + kTitleSize * kAscent, title, kTitleSize, kBlack, Anchor::Middle, Direction::Right,
              Weight::Bold);
  for (double v : xt) {
    const double px = std::round(ax.map(v, x0, x1));
    fill_rect(cr, px, y0, 1, y1 - y0, kGridGrey);
    fill_rect(cr, px, y1, 1, 5, kBlack);
    draw_text(cr, px + 0.5, y1 + 7 + kLabelSize * kAscent, tick_label(v), kLabelSize, kBlack, Anchor::Middle);
  }
  for (double v : yt) {
    const double py = std::round(ay.map(v, y1, y0));
    fill_rect(cr, x0, py, x1 - x0, 1, kGridGrey);
    fill_rect(cr, x0 - 5, py, 5, 1, kBlack);
    draw_text(cr, x0 - 8, py + 0.5 + kLabelSize * kMidline, tick_label(v), kLabelSize, kBlack, Anchor::End);
  }
  fill_rect(cr, x0, y0, 1, y1 - y0 + 1, kBlack);
  fill_rect(cr, x0, y1, x1 - x0 + 1, 1, kBlack);
  draw_text(cr, (x0 + x1) / 2, H - kMargin - 3, printable(x_label), kAxisLabelSize, kBlack, Anchor::Middle);
  draw_text(cr, kMargin + kAxisLabelSize * kAscent, (y0 + y1) / 2, printable(y_label), kAxisLabelSize, kBlack,
            Anchor::Middle, Direction::Up);

  // Each series as one anti-aliased path; a non-finite point breaks it, a lone point is a dot.
  cairo_save(cr);
  cairo_rectangle(cr, x0, y0, x1 - x0 + 1, y1 - y0 + 1);
  cairo_clip(cr);
  cairo_set_line_width(cr, 2);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  for (size_t s = 0; s < series.size(); ++s) {
    const Series& sr = series[s];
    set_color(cr, kPalette[s % kPalette.size()]);
    size_t run = 0;  // points in the current unbroken run
    double lx = 0, ly = 0;
    const auto end_run = [&] {
      if (run == 1) {
        cairo_new_sub_path(cr);
        cairo_arc(cr, lx, ly, 2.5, 0, 2 * std::numbers::pi);
        cairo_fill(cr);
      } else if (run > 1) {
        cairo_stroke(cr);
      }
      run = 0;
    };
    for (size_t n = 0; n < sr.xs.size(); ++n) {
      if (!std::isfinite(sr.xs[n]) || !std::isfinite(sr.ys[n])) {
        end_run();
        continue;
      }
      lx = ax.map(sr.xs[n], x0, x1), ly = ay.map(sr.ys[n], y1, y0);
      if (run++ == 0)
        cairo_move_to(cr, lx, ly);
      else
        cairo_line_to(cr, lx, ly);
    }
    end_run();
  }
  cairo_restore(cr);

  // Legend, top right inside the axes.
  double nmax = 0;
  for (const Series& s : series) nmax = std::max(nmax, text_width(cr, printable(s.name), kLabelSize));
  if (series.empty() || nmax == 0) return;
  const double row_h = std::round(kLabelSize * 1.4);
  const double lw = std::round(34 + nmax), lh = 8 + row_h * static_cast<double>(series.size());
  const double lx = x1 - lw - 8, ly = y0 + 8;
  fill_rect(cr, lx - 1, ly - 1, lw + 2, lh + 2, kAxisGrey);
  fill_rect(cr, lx, ly, lw, lh, kWhite);
  for (size_t s = 0; s < series.size(); ++s) {
    const double mid = ly + 4 + row_h * (static_cast<double>(s) + 0.5);
    fill_rect(cr, lx + 6, std::round(mid) - 1, 20, 2, kPalette[s % kPalette.size()]);
    draw_text(cr, lx + 30, mid + kLabelSize * kMidline, printable(series[s].name), kLabelSize, kBlack, Anchor::Start);
  }
}

Surface render_plot_surface(const std::string& title, const std::string& x_label, const std::string& y_label,
                            const std::vector<Series>& series, const LinePlotOptions& options, const char* fn) {
  check_plot(series, options, fn);
  Surface s = image_surface(options.width, options.height, fn);
  const Context cr = make_context(s.get(), fn);
  draw_line_plot(cr.get(), title, x_label, y_label, series, options, fn);
  check(cairo_status(cr.get()), fn, "drawing failed");
  return s;
}

}  // namespace

Image render_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                       const std::vector<Series>& series, const LinePlotOptions& options) {
  return to_image(render_plot_surface(title, x_label, y_label, series, options, "render_line_plot").get());
}

void write_line_plot_png(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options) {
  const char* fn = "write_line_plot_png";
  write_surface_png(path, render_plot_surface(title, x_label, y_label, series, options, fn).get(), fn);
}

void write_line_plot_svg(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options) {
  const char* fn = "write_line_plot_svg";
  check_plot(series, options, fn);
  write_svg(path, options.width, options.height, fn,
            [&](cairo_t* cr) { draw_line_plot(cr, title, x_label, y_label, series, options, fn); });
}

}  // namespace mha
