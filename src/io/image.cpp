// io/image.cpp — PNG/SVG pictures: a tiny canvas (rectangles, lines, bitmap text), the heat-map
// grid and the line plot laid out once over it, a rasteriser to PNG through libpng, and an SVG
// writer (mha/image.h).
#include "mha/image.h"

#include <png.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace mha {

namespace {

// ---- the 5×7 font --------------------------------------------------------------------------------
// One glyph per printable ASCII character (32–126), 7 rows of 5 pixels, bit 4 = leftmost column.
// Drawn by hand for mha. Every glyph advances 6 pixels (one blank column) and is 7 pixels tall.
constexpr int kGlyphW = 5, kGlyphH = 7, kAdvance = 6;
constexpr std::array<std::array<uint8_t, 7>, 95> kFont = {{
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // ' '
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04},  // '!'
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00},  // '"'
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // '#'
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04},  // '$'
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // '%'
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D},  // '&'
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // "'"
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // '('
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // ')'
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00},  // '*'
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // '+'
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08},  // ','
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // '-'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C},  // '.'
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // '/'
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E},  // '0'
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // '1'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F},  // '2'
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // '3'
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02},  // '4'
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // '5'
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E},  // '6'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // '7'
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E},  // '8'
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // '9'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00},  // ':'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08},  // ';'
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // '<'
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // '='
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // '>'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // '?'
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E},  // '@'
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // 'A'
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // 'B'
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // 'C'
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // 'D'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // 'E'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // 'F'
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // 'G'
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // 'H'
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 'I'
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // 'J'
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // 'K'
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // 'L'
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // 'M'
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // 'N'
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // 'O'
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // 'P'
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // 'Q'
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // 'R'
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // 'S'
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // 'T'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // 'U'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // 'V'
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // 'W'
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // 'X'
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04},  // 'Y'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // 'Z'
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // '['
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00},  // backslash
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // ']'
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00},  // '^'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // '_'
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00},  // '`'
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // 'a'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E},  // 'b'
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // 'c'
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F},  // 'd'
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // 'e'
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08},  // 'f'
    {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // 'g'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'h'
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // 'i'
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C},  // 'j'
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // 'k'
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 'l'
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // 'm'
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'n'
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // 'o'
    {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10},  // 'p'
    {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x01},  // 'q'
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // 'r'
    {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E},  // 's'
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06},  // 't'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // 'u'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04},  // 'v'
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // 'w'
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11},  // 'x'
    {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // 'y'
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F},  // 'z'
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // '{'
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // '|'
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // '}'
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},  // '~'
}};

const std::array<uint8_t, 7>& glyph(char ch) {
  const auto c = static_cast<unsigned char>(ch);
  return kFont[(c >= 32 && c <= 126) ? c - 32 : '?' - 32];
}

int64_t text_width(const std::string& s, int scale) { return static_cast<int64_t>(s.size()) * kAdvance * scale; }

// ---- canvases ------------------------------------------------------------------------------------

enum class Orient : uint8_t { Horizontal, Vertical };  ///< Vertical reads bottom to top

/// What the layouts draw on. Coordinates are pixels, origin top-left; text (x, y) is the top-left
/// of the text's box (for Vertical text, of the rotated box: width 7·scale, height = its length).
class Canvas {
 public:
  virtual ~Canvas() = default;
  virtual void rect(int64_t x, int64_t y, int64_t w, int64_t h, Rgb c) = 0;
  virtual void line(double x0, double y0, double x1, double y1, Rgb c, int thickness) = 0;
  virtual void text(int64_t x, int64_t y, const std::string& s, int scale, Rgb c, Orient o) = 0;
};

class RasterCanvas final : public Canvas {
 public:
  RasterCanvas(int64_t w, int64_t h) : img(w, h) {}
  void rect(int64_t x, int64_t y, int64_t w, int64_t h, Rgb c) override {
    for (int64_t yy = std::max<int64_t>(y, 0); yy < std::min(y + h, img.height); ++yy)
      for (int64_t xx = std::max<int64_t>(x, 0); xx < std::min(x + w, img.width); ++xx) img.set(xx, yy, c);
  }
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness) override {
    // Sample along the segment at sub-pixel steps, stamping a thickness × thickness square.
    const double len = std::hypot(x1 - x0, y1 - y0);
    const auto steps = static_cast<int64_t>(std::ceil(len * 2)) + 1;
    for (int64_t s = 0; s <= steps; ++s) {
      const double t = steps ? static_cast<double>(s) / static_cast<double>(steps) : 0.0;
      const auto px = static_cast<int64_t>(std::lround(x0 + t * (x1 - x0))) - thickness / 2;
      const auto py = static_cast<int64_t>(std::lround(y0 + t * (y1 - y0))) - thickness / 2;
      rect(px, py, thickness, thickness, c);
    }
  }
  void text(int64_t x, int64_t y, const std::string& s, int scale, Rgb c, Orient o) override {
    for (size_t n = 0; n < s.size(); ++n) {
      const auto& g = glyph(s[n]);
      const int64_t along = static_cast<int64_t>(n) * kAdvance * scale;
      for (int row = 0; row < kGlyphH; ++row)
        for (int col = 0; col < kGlyphW; ++col) {
          if (!(g[static_cast<size_t>(row)] & (0x10 >> col))) continue;
          if (o == Orient::Horizontal) {
            rect(x + along + col * scale, y + row * scale, scale, scale, c);
          } else {  // rotated 90° counter-clockwise: the text runs upwards from the bottom of its box
            const int64_t len = text_width(s, scale);
            rect(x + row * scale, y + len - 1 - along - col * scale - (scale - 1), scale, scale, c);
          }
        }
    }
  }
  Image img;
};

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == '&')
      out += "&amp;";
    else if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else if (ch == '"')
      out += "&quot;";
    else if (c < 32 || c > 126)
      out += '?';  // the same subset the bitmap font draws
    else
      out += ch;
  }
  return out;
}

std::string css(Rgb c) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c.r, c.g, c.b);
  return buf;
}

class SvgCanvas final : public Canvas {
 public:
  SvgCanvas(int64_t w, int64_t h) {
    os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h << "\" viewBox=\"0 0 " << w
       << ' ' << h << "\" shape-rendering=\"crispEdges\">\n";
  }
  void rect(int64_t x, int64_t y, int64_t w, int64_t h, Rgb c) override {
    os << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h << "\" fill=\"" << css(c)
       << "\"/>\n";
  }
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness) override {
    os << "<line x1=\"" << x0 << "\" y1=\"" << y0 << "\" x2=\"" << x1 << "\" y2=\"" << y1 << "\" stroke=\"" << css(c)
       << "\" stroke-width=\"" << thickness << "\" shape-rendering=\"auto\"/>\n";
  }
  void text(int64_t x, int64_t y, const std::string& s, int scale, Rgb c, Orient o) override {
    // A monospace font at 10·scale px advances about 6·scale px per character, like the bitmap font.
    const int64_t size = 10 * scale, base = 7 * scale;
    if (o == Orient::Horizontal) {
      os << "<text x=\"" << x << "\" y=\"" << y + base << "\"";
    } else {
      const int64_t bx = x + base, by = y + text_width(s, scale);
      os << "<text x=\"" << bx << "\" y=\"" << by << "\" transform=\"rotate(-90 " << bx << ' ' << by << ")\"";
    }
    os << " font-family=\"monospace\" font-size=\"" << size << "\" fill=\"" << css(c) << "\">" << xml_escape(s)
       << "</text>\n";
  }
  std::string finish() {
    os << "</svg>\n";
    return os.str();
  }

 private:
  std::ostringstream os;
};

void write_text_file(const std::string& path, const std::string& content, const char* fn) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) fail(fn, ": cannot open '", tmp, "' for writing");
    f << content;
    if (!f.flush()) fail(fn, ": cannot write '", tmp, "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    fail(fn, ": cannot rename '", tmp, "' to '", path, "'");
  }
}

// ---- PNG through libpng --------------------------------------------------------------------------
// libpng reports errors by longjmp. The functions that call setjmp hold only trivially
// destructible locals, so the jump skips no destructor; the C++ caller throws afterwards.

struct PngMessage {
  char text[256] = {};
};

void png_error_to_buffer(png_structp png, png_const_charp msg) {
  auto* m = static_cast<PngMessage*>(png_get_error_ptr(png));
  std::snprintf(m->text, sizeof m->text, "%s", msg);
  png_longjmp(png, 1);
}
void png_warning_ignored(png_structp, png_const_charp) {}

bool png_write_rows(std::FILE* f, const Image* image, png_bytep* rows, PngMessage* msg) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, msg, png_error_to_buffer, png_warning_ignored);
  if (!png) return false;
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image->width), static_cast<png_uint_32>(image->height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

/// Reads the header (and sets up 8-bit RGB conversion) into w/h; then the caller allocates rows.
bool png_read_all(std::FILE* f, png_uint_32* w, png_uint_32* h, std::vector<uint8_t>* pixels, PngMessage* msg) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, msg, png_error_to_buffer, png_warning_ignored);
  if (!png) return false;
  png_infop info = png_create_info_struct(png);
  png_bytep* rows = nullptr;
  if (!info || setjmp(png_jmpbuf(png))) {
    std::free(rows);
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  png_init_io(png, f);
  png_read_info(png, info);
  *w = png_get_image_width(png, info);
  *h = png_get_image_height(png, info);
  if (*w == 0 || *h == 0 || *w > 65535 || *h > 65535) png_error(png, "image size out of range");
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != static_cast<size_t>(*w) * 3) png_error(png, "unexpected row size");
  // resize() may throw std::bad_alloc past a longjmp target; w, h ≤ 65535 keep it to ≤ 12 GiB and
  // the caller catches it. The vector itself lives in the caller's frame.
  pixels->resize(static_cast<size_t>(*w) * *h * 3);
  rows = static_cast<png_bytep*>(std::malloc(sizeof(png_bytep) * *h));
  if (!rows) png_error(png, "out of memory");
  for (png_uint_32 y = 0; y < *h; ++y) rows[y] = pixels->data() + static_cast<size_t>(y) * *w * 3;
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  std::free(rows);
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
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
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("write_png: cannot open '", tmp, "' for writing");
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  for (int64_t y = 0; y < image.height; ++y)
    rows[static_cast<size_t>(y)] = const_cast<png_bytep>(image.rgb.data() + y * image.width * 3);
  PngMessage msg;
  const bool ok = png_write_rows(f, &image, rows.data(), &msg);
  const bool closed = std::fclose(f) == 0;
  std::error_code ec;
  if (!ok || !closed) {
    std::filesystem::remove(tmp, ec);
    fail("write_png: ", path, ": ", ok ? "cannot close the file" : msg.text);
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    fail("write_png: cannot rename '", tmp, "' to '", path, "'");
  }
}

Image read_png(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("read_png: cannot open '", path, "'");
  png_uint_32 w = 0, h = 0;
  Image img;
  PngMessage msg;
  bool ok = false;
  try {
    ok = png_read_all(f, &w, &h, &img.rgb, &msg);
  } catch (const std::bad_alloc&) {
    std::snprintf(msg.text, sizeof msg.text, "out of memory");
  }
  std::fclose(f);
  if (!ok) fail("read_png: ", path, ": ", msg.text[0] ? msg.text : "not a PNG file");
  img.width = w, img.height = h;
  return img;
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

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kAxisGrey{110, 110, 110}, kGridGrey{228, 228, 228};
constexpr int64_t kMargin = 12, kGap = 18, kTitleH = 14;

struct GridGeometry {
  int64_t H = 0, Tq = 0, Tk = 0, cell = 0, cols = 0, rows = 0;
  int64_t left = 0, bottom = 0;      ///< label space left of / below each matrix
  int64_t panel_w = 0, panel_h = 0;  ///< including labels and title
  int64_t top = 0;                   ///< y of the first panel row
  int64_t bar_x = 0, bar_h = 0;      ///< colour scale bar
  int64_t width = 0, height = 0;
  int64_t label_step_q = 1, label_step_k = 1;
  std::vector<std::string> qlabels, klabels, titles;
  HeatmapPlacement cells;
};

GridGeometry plan_grid(const Tensor& weights, const HeatmapOptions& o, const char* fn) {
  if (weights.dim() != 2 && weights.dim() != 3)
    fail(fn, ": weights must be (h, T_q, T_k) or (T_q, T_k), got ", shape_str(weights.shape()));
  GridGeometry g;
  g.H = weights.dim() == 3 ? weights.size(0) : 1;
  g.Tq = weights.size(-2), g.Tk = weights.size(-1);
  if (g.H < 1 || g.Tq < 1 || g.Tk < 1) fail(fn, ": nothing to draw in weights ", shape_str(weights.shape()));
  if (g.H > 1024 || g.Tq > 4096 || g.Tk > 4096)
    fail(fn, ": weights ", shape_str(weights.shape()), " are too large to draw (at most 1024 heads of 4096 x 4096)");
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
  for (int64_t i = 0; i < g.Tq; ++i)
    g.qlabels.push_back(o.query_labels.empty() ? std::to_string(i) : o.query_labels[static_cast<size_t>(i)]);
  for (int64_t j = 0; j < g.Tk; ++j)
    g.klabels.push_back(o.key_labels.empty() ? std::to_string(j) : o.key_labels[static_cast<size_t>(j)]);
  for (int64_t h = 0; h < g.H; ++h)
    g.titles.push_back(o.panel_titles.empty() ? "head " + std::to_string(h) : o.panel_titles[static_cast<size_t>(h)]);
  for (auto* labels : {&g.qlabels, &g.klabels})
    for (auto& s : *labels)
      if (s.size() > 12) s = s.substr(0, 11) + "~";  // keep the axes readable
  // A label needs 8 px of axis; with smaller cells only every k-th position is labelled.
  g.label_step_q = (8 + g.cell - 1) / g.cell;
  g.label_step_k = g.label_step_q;
  size_t qmax = 0, kmax = 0;
  for (const auto& s : g.qlabels) qmax = std::max(qmax, s.size());
  for (const auto& s : g.klabels) kmax = std::max(kmax, s.size());
  g.left = static_cast<int64_t>(qmax) * kAdvance + 4;
  g.bottom = static_cast<int64_t>(kmax) * kAdvance + 4;
  size_t tmax = 0;
  for (const auto& s : g.titles) tmax = std::max(tmax, s.size());
  g.panel_w = std::max(g.left + g.Tk * g.cell, static_cast<int64_t>(tmax) * kAdvance) + kGap;
  g.panel_h = kTitleH + g.Tq * g.cell + g.bottom + kGap;
  g.top = kMargin + (o.title.empty() ? 0 : 2 * kGlyphH + 10);
  g.bar_x = kMargin + g.cols * g.panel_w;
  g.bar_h = std::clamp<int64_t>(g.Tq * g.cell, 100, 260);
  const int64_t bar_w = 16 + 4 + 4 * kAdvance;     // bar, tick, "1.00"
  const int64_t legend_w = 10 + 4 + 6 * kAdvance;  // swatch + "masked"
  g.width = std::max(g.bar_x + std::max(bar_w, legend_w) + kMargin, kMargin + text_width(o.title, 2) + kMargin);
  g.height = std::max(g.top + g.rows * g.panel_h, g.top + kTitleH + g.bar_h + 40) + kMargin;
  g.cells.cell = g.cell;
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t px = kMargin + (h % g.cols) * g.panel_w, py = g.top + (h / g.cols) * g.panel_h;
    g.cells.panel_x.push_back(px + g.left);
    g.cells.panel_y.push_back(py + kTitleH);
  }
  return g;
}

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

void draw_heatmap_grid(Canvas& cv, const Tensor& weights, const HeatmapOptions& o, const GridGeometry& g) {
  cv.rect(0, 0, g.width, g.height, kWhite);
  if (!o.title.empty()) cv.text(kMargin, kMargin, o.title, 2, kBlack, Orient::Horizontal);
  const float* w = weights.data();
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t mx = g.cells.panel_x[static_cast<size_t>(h)], my = g.cells.panel_y[static_cast<size_t>(h)];
    cv.text(mx - g.left, my - kTitleH + 2, g.titles[static_cast<size_t>(h)], 1, kBlack, Orient::Horizontal);
    for (int64_t i = 0; i < g.Tq; ++i) {
      const float* row = w + (h * g.Tq + i) * g.Tk;
      for (int64_t j = 0; j < g.Tk; ++j) {
        // An exact 0 is a masked key (or a fully masked row): drawn off the colour scale.
        const Rgb c = row[j] == 0.0f ? masked_color() : heat_color(static_cast<double>(row[j]) / o.vmax);
        cv.rect(mx + j * g.cell, my + i * g.cell, g.cell, g.cell, c);
      }
    }
    // Axis labels: queries down the left, keys along the bottom (reading upwards).
    for (int64_t i = 0; i < g.Tq; i += g.label_step_q) {
      const std::string& s = g.qlabels[static_cast<size_t>(i)];
      cv.text(mx - 3 - text_width(s, 1), my + i * g.cell + (g.cell - kGlyphH) / 2, s, 1, kAxisGrey, Orient::Horizontal);
    }
    for (int64_t j = 0; j < g.Tk; j += g.label_step_k) {
      const std::string& s = g.klabels[static_cast<size_t>(j)];
      cv.text(mx + j * g.cell + (g.cell - kGlyphH) / 2, my + g.Tq * g.cell + 3, s, 1, kAxisGrey, Orient::Vertical);
    }
  }
  // Colour scale: vmax at the top, 0 at the bottom, then the masked swatch.
  const int64_t bx = g.bar_x, by = g.top + kTitleH;
  cv.text(bx, g.top + 2, "weight", 1, kBlack, Orient::Horizontal);
  for (int64_t y = 0; y < g.bar_h; ++y)
    cv.rect(bx, by + y, 16, 1, heat_color(1.0 - static_cast<double>(y) / static_cast<double>(g.bar_h - 1)));
  for (int tick = 0; tick <= 4; ++tick) {
    const int64_t y = by + (g.bar_h - 1) * tick / 4;
    cv.rect(bx + 16, y, 4, 1, kBlack);
    cv.text(bx + 22, y - kGlyphH / 2, fixed2(o.vmax * (4 - tick) / 4.0), 1, kBlack, Orient::Horizontal);
  }
  const int64_t ly = by + g.bar_h + 14;
  cv.rect(bx, ly, 10, 10, masked_color());
  cv.text(bx + 14, ly + 1, "masked", 1, kBlack, Orient::Horizontal);
}

}  // namespace

HeatmapPlacement heatmap_placement(const Tensor& weights, const HeatmapOptions& options) {
  return plan_grid(weights, options, "heatmap_placement").cells;
}

Image render_heatmap_grid(const Tensor& weights, const HeatmapOptions& options) {
  const GridGeometry g = plan_grid(weights, options, "render_heatmap_grid");
  RasterCanvas cv(g.width, g.height);
  draw_heatmap_grid(cv, weights, options, g);
  return std::move(cv.img);
}

void write_heatmap_png(const std::string& path, const Tensor& weights, const HeatmapOptions& options) {
  write_png(path, render_heatmap_grid(weights, options));
}

void write_heatmap_svg(const std::string& path, const Tensor& weights, const HeatmapOptions& options) {
  const GridGeometry g = plan_grid(weights, options, "write_heatmap_svg");
  SvgCanvas cv(g.width, g.height);
  draw_heatmap_grid(cv, weights, options, g);
  write_text_file(path, cv.finish(), "write_heatmap_svg");
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

void draw_line_plot(Canvas& cv, const std::string& title, const std::string& x_label, const std::string& y_label,
                    const std::vector<Series>& series, const LinePlotOptions& o, const char* fn) {
  const int64_t W = o.width, Hh = o.height;
  const Axis ax = make_axis(series, true, o.log_x, fn), ay = make_axis(series, false, o.log_y, fn);
  const std::vector<double> xt = ticks_for(ax.lo, ax.hi, ax.log), yt = ticks_for(ay.lo, ay.hi, ay.log);
  size_t ylab = 0;
  for (double v : yt) ylab = std::max(ylab, tick_label(v).size());
  const int64_t x0 = kMargin + kGlyphH + 8 + static_cast<int64_t>(ylab) * kAdvance + 6, x1 = W - kMargin - 8;
  const int64_t y0 = kMargin + (title.empty() ? 0 : 2 * kGlyphH + 12), y1 = Hh - kMargin - kGlyphH - 8 - kGlyphH - 8;
  if (x1 - x0 < 40 || y1 - y0 < 40) fail(fn, ": a ", W, " x ", Hh, " plot is too small to draw");
  cv.rect(0, 0, W, Hh, kWhite);
  if (!title.empty()) cv.text((W - text_width(title, 2)) / 2, kMargin, title, 2, kBlack, Orient::Horizontal);
  for (double v : xt) {
    const auto px = static_cast<int64_t>(std::lround(ax.map(v, static_cast<double>(x0), static_cast<double>(x1))));
    cv.rect(px, y0, 1, y1 - y0, kGridGrey);
    cv.rect(px, y1, 1, 5, kBlack);
    const std::string s = tick_label(v);
    cv.text(px - text_width(s, 1) / 2, y1 + 7, s, 1, kBlack, Orient::Horizontal);
  }
  for (double v : yt) {
    const auto py = static_cast<int64_t>(std::lround(ay.map(v, static_cast<double>(y1), static_cast<double>(y0))));
    cv.rect(x0, py, x1 - x0, 1, kGridGrey);
    cv.rect(x0 - 5, py, 5, 1, kBlack);
    const std::string s = tick_label(v);
    cv.text(x0 - 7 - text_width(s, 1), py - kGlyphH / 2, s, 1, kBlack, Orient::Horizontal);
  }
  cv.rect(x0, y0, 1, y1 - y0 + 1, kBlack);
  cv.rect(x0, y1, x1 - x0 + 1, 1, kBlack);
  cv.text((x0 + x1 - text_width(x_label, 1)) / 2, Hh - kMargin - kGlyphH, x_label, 1, kBlack, Orient::Horizontal);
  cv.text(kMargin, (y0 + y1 - text_width(y_label, 1)) / 2, y_label, 1, kBlack, Orient::Vertical);

  for (size_t s = 0; s < series.size(); ++s) {
    const Series& sr = series[s];
    if (sr.xs.size() != sr.ys.size())
      fail(fn, ": series '", sr.name, "' has ", sr.xs.size(), " x values and ", sr.ys.size(), " y values");
    const Rgb c = kPalette[s % kPalette.size()];
    bool have_prev = false;
    double px = 0, py = 0;
    for (size_t n = 0; n < sr.xs.size(); ++n) {
      if (!std::isfinite(sr.xs[n]) || !std::isfinite(sr.ys[n])) {
        have_prev = false;
        continue;
      }
      const double qx = ax.map(sr.xs[n], static_cast<double>(x0), static_cast<double>(x1));
      const double qy = ay.map(sr.ys[n], static_cast<double>(y1), static_cast<double>(y0));
      if (have_prev)
        cv.line(px, py, qx, qy, c, 2);
      else if (n + 1 == sr.xs.size() || !std::isfinite(sr.ys[n + 1]))
        cv.rect(std::lround(qx) - 2, std::lround(qy) - 2, 5, 5, c);
      px = qx, py = qy, have_prev = true;
    }
  }
  // Legend, top right inside the axes.
  size_t nmax = 0;
  for (const Series& s : series) nmax = std::max(nmax, s.name.size());
  if (series.empty() || nmax == 0) return;
  const int64_t lw = 30 + static_cast<int64_t>(nmax) * kAdvance, lh = 6 + 12 * static_cast<int64_t>(series.size());
  const int64_t lx = x1 - lw - 6, ly = y0 + 6;
  cv.rect(lx - 1, ly - 1, lw + 2, lh + 2, kAxisGrey);
  cv.rect(lx, ly, lw, lh, kWhite);
  for (size_t s = 0; s < series.size(); ++s) {
    const int64_t yy = ly + 4 + 12 * static_cast<int64_t>(s);
    cv.rect(lx + 5, yy + 3, 18, 2, kPalette[s % kPalette.size()]);
    cv.text(lx + 27, yy, series[s].name, 1, kBlack, Orient::Horizontal);
  }
}

void check_plot_size(const LinePlotOptions& o, const char* fn) {
  if (o.width < 100 || o.height < 100 || o.width > 8192 || o.height > 8192)
    fail(fn, ": plot size ", o.width, " x ", o.height, " must be within 100 .. 8192 pixels");
}

}  // namespace

Image render_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                       const std::vector<Series>& series, const LinePlotOptions& options) {
  check_plot_size(options, "render_line_plot");
  RasterCanvas cv(options.width, options.height);
  draw_line_plot(cv, title, x_label, y_label, series, options, "render_line_plot");
  return std::move(cv.img);
}

void write_line_plot_png(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options) {
  write_png(path, render_line_plot(title, x_label, y_label, series, options));
}

void write_line_plot_svg(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options) {
  check_plot_size(options, "write_line_plot_svg");
  SvgCanvas cv(options.width, options.height);
  draw_line_plot(cv, title, x_label, y_label, series, options, "write_line_plot_svg");
  write_text_file(path, cv.finish(), "write_line_plot_svg");
}

}  // namespace mha
