// The README shows examples/tour.cpp verbatim; keep the two the same.
#include <fstream>
#include <sstream>
#include <string>

#include "support/test_support.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Readme, TourExampleMatchesExamplesTourCpp) {
  const std::string readme = read_file(MHA_SOURCE_DIR "/README.md");
  const std::string tour = read_file(MHA_SOURCE_DIR "/examples/tour.cpp");
  const std::string begin = "<!-- tour:begin -->\n```cpp\n", end = "```\n<!-- tour:end -->";
  const size_t a = readme.find(begin), b = readme.find(end);
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  EXPECT_EQ(readme.substr(a + begin.size(), b - a - begin.size()), tour);
}

TEST(Readme, OpensWithTheTwoCommands) {
  const std::string readme = read_file(MHA_SOURCE_DIR "/README.md");
  const size_t demo = readme.find("bash scripts/demo.sh"), test = readme.find("bash scripts/test.sh");
  ASSERT_NE(demo, std::string::npos);
  ASSERT_NE(test, std::string::npos);
  EXPECT_LT(demo, 400u);
  EXPECT_LT(test, 500u);
}

}  // namespace
