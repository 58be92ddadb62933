// mha/image.h — pictures of attention: heat-map grids and line plots, as PNG or SVG.
//
// Link mha::image (the core mha::mha draws nothing). Pictures are drawn with cairo: each is laid
// out once and drawn by one routine onto either an image surface (PNG, or an Image to read pixels
// from) or an SVG surface, so both show the same picture. Lines are anti-aliased; text is DejaVu
// Sans (Debian's fonts-dejavu-core, found through fontconfig), any valid UTF-8, and in SVG it is
// drawn as glyph outlines. Heat-map cells are pixel-aligned rectangles, so the pixel at a cell's
// centre has exactly the cell's colour.
//
// Heat maps: one panel per head, rows = queries (top to bottom), columns = keys (left to right),
// colour = weight on a fixed scale [0, vmax] (vmax = 1 by default: weights are probabilities)
// from dark (0) to the hot colour heat_color(1) (light yellow). A weight of exactly 0 — a masked
// key, or a fully masked row — is drawn in masked_color(), a light grey that is not on the scale.
//
// fontconfig keeps caches that it frees only in FcFini(), which a library must not call; leak
// checkers report them (tests/lsan.supp suppresses them for mha's sanitizer build).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const Rgb&, const Rgb&) = default;
};

/// An 8-bit RGB raster, row-major, 3 bytes per pixel.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;

  Image() = default;
  Image(int64_t w, int64_t h, Rgb fill = {255, 255, 255});
  Rgb pixel(int64_t x, int64_t y) const;  ///< throws mha::Error outside the image
  void set(int64_t x, int64_t y, Rgb c);  ///< ignores pixels outside the image
};

/// Writes an 8-bit RGB PNG (to a temporary file beside `path`, then renamed). Throws mha::Error.
void write_png(const std::string& path, const Image& image);
/// Reads any PNG (grey, palette, 16-bit, alpha), converted to 8-bit RGB (alpha dropped, colours
/// un-premultiplied). Throws mha::Error.
Image read_png(const std::string& path);

/// The colour scale: t in [0, 1] (clamped) from dark to the hot colour at t = 1.
Rgb heat_color(double t);
/// Cells whose weight is exactly 0 (masked out, or a fully masked row).
Rgb masked_color();

struct HeatmapOptions {
  std::string title;                      ///< above the grid; empty = none
  std::vector<std::string> panel_titles;  ///< one per head; empty = "head i"
  std::vector<std::string> query_labels;  ///< T_q row labels; empty = row indices
  std::vector<std::string> key_labels;    ///< T_k column labels; empty = column indices
  int64_t cell_pixels = 0;                ///< side of one cell; 0 = chosen from T (3..28 px)
  int64_t columns = 0;                    ///< panels per row; 0 = ⌈√h⌉
  double vmax = 1.0;                      ///< weight drawn in the hot colour (and above)
};

/// weights: (h, T_q, T_k) — one panel per head — or (T_q, T_k) for a single panel.
Image render_heatmap_grid(const Tensor& weights, const HeatmapOptions& options = {});
void write_heatmap_png(const std::string& path, const Tensor& weights, const HeatmapOptions& options = {});
void write_heatmap_svg(const std::string& path, const Tensor& weights, const HeatmapOptions& options = {});

/// Where a cell (row i, column j) of panel `head` lands in render_heatmap_grid's image: the
/// pixel at the cell's centre. For tests and for anyone annotating the picture.
struct HeatmapPlacement {
  int64_t cell = 0;
  std::vector<int64_t> panel_x, panel_y;  ///< top-left pixel of each panel's matrix
  int64_t center_x(int64_t head, int64_t j) const {
    return panel_x.at(static_cast<size_t>(head)) + j * cell + cell / 2;
  }
  int64_t center_y(int64_t head, int64_t i) const {
    return panel_y.at(static_cast<size_t>(head)) + i * cell + cell / 2;
  }
};
HeatmapPlacement heatmap_placement(const Tensor& weights, const HeatmapOptions& options = {});

// ---- line plots --------------------------------------------------------------------------------

struct Series {
  std::string name;
  std::vector<double> xs, ys;  ///< same length; non-finite points break the line
};

struct LinePlotOptions {
  bool log_x = false;  ///< logarithmic x axis (every x must then be > 0)
  bool log_y = false;  ///< logarithmic y axis (every y must then be > 0)
  int64_t width = 720, height = 440;
};

Image render_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                       const std::vector<Series>& series, const LinePlotOptions& options = {});
void write_line_plot_png(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options = {});
void write_line_plot_svg(const std::string& path, const std::string& title, const std::string& x_label,
                         const std::string& y_label, const std::vector<Series>& series,
                         const LinePlotOptions& options = {});

}  // namespace mha
