// Image files (vision/image_file.h): PNGs of every colour type written here with libpng, with
// known pixels; JPEGs compressed here with libjpeg at quality 100 (decoded within a few levels);
// and the refusals: truncated files, another format, a missing file, too many pixels.
#include <gtest/gtest.h>
#include <png.h>

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <filesystem>
#include <fstream>
#include <jpeglib.h>
#include <string>
#include <vector>

#include "qtrain/error.h"
#include "vision/image_file.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("qtrain-image-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() { fs::remove_all(dir); }
  std::string at(const std::string& name) const { return (dir / name).string(); }
};

// Writes a PNG of `color_type` and `depth` from rows of packed samples (as libpng takes them).
void write_png(const std::string& path, int w, int h, int color_type, int depth,
               const std::vector<std::vector<std::uint8_t>>& rows, bool interlaced = false,
               const std::vector<png_color>& palette = {},
               const std::vector<std::uint8_t>& trns = {}) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_init_io(png, f);
  png_set_IHDR(png, info, w, h, depth, color_type,
               interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  if (!trns.empty()) png_set_tRNS(png, info, trns.data(), static_cast<int>(trns.size()), nullptr);
  png_write_info(png, info);
  std::vector<png_bytep> ptrs;
  for (const auto& r : rows) ptrs.push_back(const_cast<png_bytep>(r.data()));
  png_write_image(png, ptrs.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  std::fclose(f);
}

std::uint8_t red(int x, int y) { return static_cast<std::uint8_t>(10 * x + y); }
std::uint8_t green(int x, int y) { return static_cast<std::uint8_t>(200 - 7 * y + x); }
std::uint8_t blue(int x, int y) { return static_cast<std::uint8_t>((x * y) % 251); }

void expect_rgb(const DecodedImage& img, int w, int h) {
  ASSERT_EQ(img.w, w);
  ASSERT_EQ(img.h, h);
  const std::size_t n = static_cast<std::size_t>(w) * h;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const std::size_t p = static_cast<std::size_t>(y) * w + x;
      ASSERT_EQ(img.planes[p], red(x, y)) << x << "," << y;
      ASSERT_EQ(img.planes[n + p], green(x, y)) << x << "," << y;
      ASSERT_EQ(img.planes[2 * n + p], blue(x, y)) << x << "," << y;
    }
}

TEST(ImageFile, PngColourTypesBecomeRgb) {
  TempDir t;
  const int w = 13, h = 9;
  std::vector<std::vector<std::uint8_t>> rgb(h), rgba(h), rgb16(h), gray(h), gray_alpha(h);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      for (auto v : {red(x, y), green(x, y), blue(x, y)}) {
        rgb[y].push_back(v);
        rgba[y].push_back(v);
        rgb16[y].push_back(v);
        rgb16[y].push_back(static_cast<std::uint8_t>(255 - v));  // low byte: dropped
      }
      rgba[y].push_back(static_cast<std::uint8_t>(x * 19));      // alpha: dropped, not composited
      gray[y].push_back(red(x, y));
      gray_alpha[y].push_back(red(x, y));
      gray_alpha[y].push_back(7);
    }
  write_png(t.at("rgb.png"), w, h, PNG_COLOR_TYPE_RGB, 8, rgb);
  expect_rgb(decode_image(t.at("rgb.png"), "rgb"), w, h);
  write_png(t.at("rgba.png"), w, h, PNG_COLOR_TYPE_RGB_ALPHA, 8, rgba);
  expect_rgb(decode_image(t.at("rgba.png"), "rgba"), w, h);
  write_png(t.at("rgb16.png"), w, h, PNG_COLOR_TYPE_RGB, 16, rgb16);
  expect_rgb(decode_image(t.at("rgb16.png"), "rgb16"), w, h);
  write_png(t.at("interlaced.png"), w, h, PNG_COLOR_TYPE_RGB, 8, rgb, true);
  expect_rgb(decode_image(t.at("interlaced.png"), "interlaced"), w, h);
  for (const auto& [name, type, rows] :
       {std::tuple{"gray.png", PNG_COLOR_TYPE_GRAY, gray},
        std::tuple{"gray_alpha.png", PNG_COLOR_TYPE_GRAY_ALPHA, gray_alpha}}) {
    write_png(t.at(name), w, h, type, 8, rows);
    const DecodedImage img = decode_image(t.at(name), name);
    const std::size_t n = static_cast<std::size_t>(w) * h;
    for (int c = 0; c < 3; ++c)
      for (std::size_t p = 0; p < n; ++p)
        ASSERT_EQ(img.planes[c * n + p], red(static_cast<int>(p % w), static_cast<int>(p / w)))
            << name << " channel " << c;
  }
  // A 4-colour palette with transparency, 2 bits a pixel: colour i at x % 4.
  const std::vector<png_color> palette = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}, {9, 99, 199}};
  std::vector<std::vector<std::uint8_t>> idx(2, std::vector<std::uint8_t>(2));
  for (auto& r : idx) r = {0x1B, 0x1B};  // 00 01 10 11, twice: 8 pixels a row
  write_png(t.at("palette.png"), 8, 2, PNG_COLOR_TYPE_PALETTE, 2, idx, false, palette, {0, 128});
  const DecodedImage pal = decode_image(t.at("palette.png"), "palette");
  ASSERT_EQ(pal.w, 8);
  for (int x = 0; x < 8; ++x) {
    EXPECT_EQ(pal.planes[x], palette[x % 4].red) << x;
    EXPECT_EQ(pal.planes[16 + x], palette[x % 4].green) << x;
    EXPECT_EQ(pal.planes[32 + x], palette[x % 4].blue) << x;
  }
}

// Compresses [h, w, components] samples at quality 100 without chroma subsampling.
void write_jpeg(const std::string& path, int w, int h, int components,
                const std::vector<std::uint8_t>& samples) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  jpeg_stdio_dest(&c, f);
  c.image_width = w;
  c.image_height = h;
  c.input_components = components;
  c.in_color_space = components == 3 ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 100, TRUE);
  for (int i = 0; i < c.num_components; ++i) c.comp_info[i].h_samp_factor = c.comp_info[i].v_samp_factor = 1;
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(samples.data() + static_cast<std::size_t>(c.next_scanline) * w * components);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::fclose(f);
}

TEST(ImageFile, JpegDecodesCloseToItsSource) {
  TempDir t;
  const int w = 40, h = 24;
  std::vector<std::uint8_t> rgb, gray;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      // smooth: JPEG keeps it within a few levels at quality 100
      const std::uint8_t r = static_cast<std::uint8_t>(4 * x + 20), g = static_cast<std::uint8_t>(6 * y + 30),
                         b = static_cast<std::uint8_t>(2 * (x + y) + 50);
      rgb.insert(rgb.end(), {r, g, b});
      gray.push_back(g);
    }
  write_jpeg(t.at("rgb.jpg"), w, h, 3, rgb);
  write_jpeg(t.at("gray.jpg"), w, h, 1, gray);
  const DecodedImage a = decode_image(t.at("rgb.jpg"), "rgb.jpg");
  const DecodedImage b = decode_image(t.at("gray.jpg"), "gray.jpg");
  ASSERT_EQ(a.w, w);
  ASSERT_EQ(a.h, h);
  ASSERT_EQ(b.w, w);
  const std::size_t n = static_cast<std::size_t>(w) * h;
  int worst = 0;
  for (std::size_t p = 0; p < n; ++p)
    for (int c = 0; c < 3; ++c) {
      worst = std::max(worst, std::abs(a.planes[c * n + p] - rgb[3 * p + c]));
      worst = std::max(worst, std::abs(b.planes[c * n + p] - gray[p]));  // replicated
    }
  EXPECT_LE(worst, 3);
  EXPECT_EQ(b.planes[5], b.planes[n + 5]);
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ImageFile, RefusesBrokenMissingForeignAndHugeFiles) {
  TempDir t;
  std::vector<std::uint8_t> rgb(64 * 64 * 3, 100);
  write_jpeg(t.at("whole.jpg"), 64, 64, 3, rgb);
  std::vector<std::vector<std::uint8_t>> rows(64, std::vector<std::uint8_t>(64 * 3, 100));
  write_png(t.at("whole.png"), 64, 64, PNG_COLOR_TYPE_RGB, 8, rows);
  for (const char* name : {"whole.jpg", "whole.png"}) {  // cut in half
    const auto size = fs::file_size(t.at(name));
    fs::copy_file(t.at(name), t.at(std::string("cut-") + name));
    fs::resize_file(t.at(std::string("cut-") + name), size / 2);
  }
  EXPECT_NE(what_of([&] { decode_image(t.at("cut-whole.jpg"), "a.jsonl:3: cut.jpg"); })
                .find("a.jsonl:3: cut.jpg: not a readable JPEG file: Premature end of JPEG file"),
            std::string::npos);
  EXPECT_NE(what_of([&] { decode_image(t.at("cut-whole.png"), "cut.png"); })
                .find("cut.png: not a readable PNG file"),
            std::string::npos);
  std::ofstream(t.at("notes.txt")) << "hello, not an image\n";
  EXPECT_NE(what_of([&] { decode_image(t.at("notes.txt"), "n"); })
                .find("is neither a JPEG nor a PNG file"),
            std::string::npos);
  std::ofstream(t.at("empty.png")).flush();
  EXPECT_NE(what_of([&] { decode_image(t.at("empty.png"), "e"); }).find("neither a JPEG nor a PNG"),
            std::string::npos);
  EXPECT_NE(what_of([&] { decode_image(t.at("missing.png"), "m"); }).find("m: cannot open"),
            std::string::npos);
  for (const char* name : {"whole.jpg", "whole.png"})
    EXPECT_NE(what_of([&] { decode_image(t.at(name), "big", 4095); })
                  .find("big: 64 x 64 pixels, more than the 4095 an image may have"),
              std::string::npos)
        << name;
  EXPECT_EQ(decode_image(t.at("whole.png"), "ok", 4096).w, 64);  // at the limit: accepted
}

}  // namespace
}  // namespace qt
