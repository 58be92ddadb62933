// Pictures: PNG round trips, heat-map grids and line plots, read back from the PNG and checked
// at the cells and lines they must show.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "mha/image.h"
#include "support/test_support.h"

namespace mha {
namespace {

TEST(Image, PngRoundTripsExactly) {
  Image img(7, 5);
  for (int64_t y = 0; y < 5; ++y)
    for (int64_t x = 0; x < 7; ++x)
      img.set(x, y, {static_cast<uint8_t>(x * 30), static_cast<uint8_t>(y * 50), static_cast<uint8_t>(x + y)});
  const std::string path = mha::testing::temp_dir() + "/rt.png";
  write_png(path, img);
  const Image back = read_png(path);
  EXPECT_EQ(back.width, 7);
  EXPECT_EQ(back.height, 5);
  EXPECT_EQ(back.rgb, img.rgb);
  size_t entries = 0;  // no temporary left beside it
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    ++entries;
  EXPECT_EQ(entries, 1u);
}

// A picture that replaces a file takes its permissions, a read-only one included (cairo writes the
// temporary by name, so it stays owner-writable until then); a new one gets 0666 less the umask.
TEST(Image, ReplacedPicturesKeepTheirPermissions) {
  namespace fs = std::filesystem;
  const Image img(3, 2);
  const std::string path = mha::testing::temp_dir() + "/p.png";
  for (const fs::perms mode : {fs::perms::owner_read | fs::perms::owner_write, fs::perms::owner_read}) {
    write_png(path, img);
    fs::permissions(path, mode);
    write_png(path, img);
    EXPECT_EQ(fs::status(path).permissions(), mode);
    EXPECT_EQ(read_png(path).rgb, img.rgb);
    fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
  }
}

// A NUL in the path wrote (and read) the file named by the part before it; a name near the 255-byte
// limit failed, its temporary being the name plus ".tmp".
TEST(Image, NulPathsAreRefusedLongNamesWritten) {
  const std::string dir = mha::testing::temp_dir();
  const Image img(3, 2);
  const std::string nul = dir + "/a" + std::string(1, '\0') + "b.png";
  EXPECT_THROW(write_png(nul, img), Error);
  EXPECT_THROW(read_png(nul), Error);
  EXPECT_FALSE(std::filesystem::exists(dir + "/a"));
  const std::string longest = dir + "/" + std::string(251, 'x') + ".png";
  write_png(longest, img);
  EXPECT_EQ(read_png(longest).width, 3);
}

TEST(Image, ReadPngRejectsOtherFiles) {
  const std::string path = mha::testing::temp_dir() + "/not.png";
  std::ofstream(path) << "definitely not a png";
  EXPECT_THROW(read_png(path), Error);
  EXPECT_THROW(read_png(path + ".missing"), Error);
  EXPECT_THROW(write_png(path, Image()), Error);
}

TEST(Image, HeatmapShowsDiagonalMaskedCellsAndMaskedRows) {
  const int64_t T = 6;
  Tensor w({3, T, T});
  for (int64_t i = 0; i < T; ++i) {
    w.at({0, i, i}) = 1.0f;                                                               // head 0: the diagonal
    for (int64_t j = 0; j <= i; ++j) w.at({1, i, j}) = 1.0f / static_cast<float>(i + 1);  // causal uniform
    if (i != 2)
      for (int64_t j = 0; j < T; ++j) w.at({2, i, j}) = 1.0f / T;  // row 2 fully masked
  }
  HeatmapOptions opt;
  opt.title = "test";
  opt.panel_titles = {"head 0: self_attend", "head 1: broad", "head 2: broad"};
  opt.query_labels = opt.key_labels = {"The", "cat", "sat", "on", "the", "mat"};
  const std::string path = mha::testing::temp_dir() + "/heads.png";
  write_heatmap_png(path, w, opt);
  const Image img = read_png(path);
  const Image direct = render_heatmap_grid(w, opt);
  EXPECT_EQ(img.width, direct.width);
  EXPECT_EQ(img.height, direct.height);
  EXPECT_EQ(img.rgb, direct.rgb);
  const HeatmapPlacement L = heatmap_placement(w, opt);
  EXPECT_GE(L.cell, 8);
  const Rgb hot = heat_color(1.0);
  for (int64_t i = 0; i < T; ++i) {
    EXPECT_EQ(img.pixel(L.center_x(0, i), L.center_y(0, i)), hot) << "diagonal cell " << i;
    if (i + 1 < T) {
      EXPECT_EQ(img.pixel(L.center_x(0, i + 1), L.center_y(0, i)), masked_color());
    }
  }
  EXPECT_EQ(img.pixel(L.center_x(1, 5), L.center_y(1, 0)), masked_color()) << "causally masked cell is blank";
  EXPECT_EQ(img.pixel(L.center_x(1, 0), L.center_y(1, 0)), hot);
  EXPECT_EQ(img.pixel(L.center_x(1, 0), L.center_y(1, 3)), heat_color(0.25));
  for (int64_t j = 0; j < T; ++j) {
    EXPECT_EQ(img.pixel(L.center_x(2, j), L.center_y(2, 2)), masked_color()) << "fully masked row";
    EXPECT_EQ(img.pixel(L.center_x(2, j), L.center_y(2, 1)), heat_color(1.0 / T));
  }
  // Colours on the scale are never the masked colour.
  for (int n = 0; n <= 100; ++n) EXPECT_NE(heat_color(n / 100.0), masked_color());
  // Text was drawn (anti-aliased, so not compared pixel by pixel): the title puts dark ink above
  // the panel titles, and every query row has its label left of the matrix.
  const auto dark = [](Rgb c) { return std::max({c.r, c.g, c.b}) < 96; };
  const auto not_white = [](Rgb c) { return c != Rgb{255, 255, 255}; };
  const auto count = [&](int64_t x0, int64_t x1, int64_t y0, int64_t y1, auto pred) {
    int64_t n = 0;
    for (int64_t y = y0; y < y1; ++y)
      for (int64_t x = x0; x < x1; ++x) n += pred(img.pixel(x, y));
    return n;
  };
  const int64_t title_band = L.panel_y[0] - 20;  // the panel titles sit just above the matrices
  EXPECT_GT(count(0, img.width, 0, title_band, dark), 20) << "the title";
  for (int64_t i = 0; i < T; ++i) {
    const int64_t y = L.panel_y[0] + i * L.cell;
    EXPECT_GT(count(L.panel_x[0] - 30, L.panel_x[0] - 1, y, y + L.cell, not_white), 5) << "label of query row " << i;
  }
  HeatmapOptions untitled = opt;
  untitled.title.clear();
  EXPECT_LT(heatmap_placement(w, untitled).panel_y[0], L.panel_y[0]) << "no title, no room for one";

  const std::string svg = mha::testing::temp_dir() + "/heads.svg";
  write_heatmap_svg(svg, w, opt);
  std::ifstream f(svg);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // The same picture: the PNG's size, and text as glyph outlines (cairo's SVG has no <text>).
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("width=\"" + std::to_string(img.width) + "px\""), std::string::npos);
  EXPECT_NE(text.find("height=\"" + std::to_string(img.height) + "px\""), std::string::npos);
  EXPECT_NE(text.find("<symbol"), std::string::npos) << "glyphs";
  EXPECT_NE(text.find("</svg>"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(svg + ".tmp"));
}

TEST(Image, LabelsMayBeAnyText) {
  // UTF-8 is drawn as such; bytes that are not valid UTF-8 (stray, overlong, a surrogate) and
  // control characters become '?' rather than an error (cairo refuses invalid UTF-8).
  const Tensor w({1, 3, 3}, 0.5f);
  HeatmapOptions o;
  o.title = "caf\xc3\xa9 \xe2\x86\x92 attention";
  o.query_labels = o.key_labels = {"\xe6\x97\xa5\xe6\x9c\xac", "bad\xff\xfe\xc0\xaf", "tab\there\xed\xa0\x80"};
  o.panel_titles = {"a label much longer than twelve characters"};
  EXPECT_NO_THROW(render_heatmap_grid(w, o));
  EXPECT_NO_THROW(render_line_plot("\xc3(", "x\x01", "y", {{"\xff", {1, 2}, {1, 2}}}));
}

TEST(Image, HeatmapRejectsBadOptions) {
  const Tensor w({2, 3, 3}, 0.25f);
  HeatmapOptions o;
  o.key_labels = {"a", "b"};
  EXPECT_THROW(render_heatmap_grid(w, o), Error);
  EXPECT_THROW(render_heatmap_grid(Tensor({3}, 1.0f)), Error);
  HeatmapOptions v;
  v.vmax = 0;
  EXPECT_THROW(render_heatmap_grid(w, v), Error);
  EXPECT_NO_THROW(render_heatmap_grid(Tensor({3, 4}, 0.25f)));  // a single (T_q, T_k) panel
  // One 1 x 4096 row in 64-pixel cells is 262,000 pixels wide: past cairo's 32767, named with its
  // size and what to change (it was cairo's 'invalid value').
  HeatmapOptions wide;
  wide.cell_pixels = 64;
  try {
    (void)render_heatmap_grid(Tensor({1, 4096}, 0.25f), wide);
    ADD_FAILURE() << "a picture past 32767 pixels was drawn";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most 32767 on a side"), std::string::npos) << e.what();
  }
}

TEST(Image, LinePlotDrawsSeriesAndLegend) {
  Series a{"loss", {1, 10, 100, 1000}, {4.0, 2.0, 1.0, 0.5}};
  Series b{"baseline", {1, 1000}, {3.0, 3.0}};
  LinePlotOptions o;
  o.log_x = true;
  const std::string path = mha::testing::temp_dir() + "/plot.png";
  write_line_plot_png(path, "training loss", "step", "loss", {a, b}, o);
  const Image img = read_png(path);
  EXPECT_EQ(img.width, o.width);
  EXPECT_EQ(img.height, o.height);
  int64_t blue = 0, orange = 0;
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) {
      blue += img.pixel(x, y) == Rgb{31, 119, 180};
      orange += img.pixel(x, y) == Rgb{230, 110, 10};
    }
  EXPECT_GT(blue, 200);  // a 2-px line across the plot
  EXPECT_GT(orange, 200);
  EXPECT_THROW(render_line_plot("t", "x", "y", {{"bad", {0, 1}, {1, 2}}}, o), Error);  // x = 0 on log axis
  EXPECT_THROW(render_line_plot("t", "x", "y", {{"bad", {1, 2}, {1}}}), Error);
  EXPECT_NO_THROW(render_line_plot("empty", "x", "y", {}));
  EXPECT_NO_THROW(render_line_plot("flat", "x", "y", {{"c", {1, 2, 3}, {5, 5, 5}}}));
  const std::string svg = mha::testing::temp_dir() + "/plot.svg";
  write_line_plot_svg(svg, "training loss", "step", "loss", {a, b}, o);
  EXPECT_TRUE(std::filesystem::file_size(svg) > 500);
}

}  // namespace
}  // namespace mha
