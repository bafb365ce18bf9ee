// JPEG through libjpeg(-turbo)'s classic API, PNG through libpng's; both report errors by
// longjmp back into the decoder, which frees what it holds and throws a UserError there.
#include "vision/image_file.h"

#include <png.h>
// jpeglib.h needs <cstdio> first; jerror.h names the warning codes.
#include <cstdio>
#include <jpeglib.h>
#include <jerror.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "qtrain/error.h"

namespace qt {

namespace {

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

// ---- JPEG -----------------------------------------------------------------------------------

struct JpegError {
  jpeg_error_mgr mgr;  // first: libjpeg's callbacks get a pointer to it
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

// libjpeg only warns where the data ends early and fills the rest with grey; PIL refuses such a
// file ("image file is truncated"), and so does qtrain. Other warnings (extraneous bytes before
// a marker) pass, as in PIL.
void jpeg_warn(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(cinfo);
}

// Planes [3, h, w] from interleaved rows [h, w, 3].
DecodedImage to_planes(const std::uint8_t* rgb, int h, int w) {
  DecodedImage img;
  img.h = h;
  img.w = w;
  const std::size_t n = static_cast<std::size_t>(h) * w;
  img.planes.resize(3 * n);
  for (std::size_t p = 0; p < n; ++p)
    for (int c = 0; c < 3; ++c) img.planes[c * n + p] = rgb[3 * p + c];
  return img;
}

// Within the decoders, between setjmp and the last library call, only trivially destructible
// locals: what a longjmp must free is held by volatile pointers and freed at the jump point.
DecodedImage decode_jpeg(std::FILE* f, const std::string& what, std::int64_t max_pixels) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  err.message[0] = '\0';
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_warn;
  std::uint8_t* volatile pixels = nullptr;  // [h, w, 3]
  char refusal[160] = "";
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    std::free(pixels);
    if (refusal[0] != '\0') fail_user("{}: {}", what, refusal);
    fail_user("{}: not a readable JPEG file: {}", what, err.message);
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, f);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(refusal, sizeof refusal, "a CMYK JPEG; convert it to RGB");
    std::longjmp(err.jump, 1);
  }
  if (static_cast<std::int64_t>(cinfo.image_width) * cinfo.image_height > max_pixels) {
    std::snprintf(refusal, sizeof refusal, "%u x %u pixels, more than the %lld an image may have",
                  cinfo.image_width, cinfo.image_height, static_cast<long long>(max_pixels));
    std::longjmp(err.jump, 1);
  }
  cinfo.out_color_space = JCS_RGB;  // grayscale replicated
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&cinfo);
  const int h = static_cast<int>(cinfo.output_height), w = static_cast<int>(cinfo.output_width);
  pixels = static_cast<std::uint8_t*>(std::malloc(static_cast<std::size_t>(h) * w * 3));
  if (pixels == nullptr) {
    std::snprintf(refusal, sizeof refusal, "out of memory for %d x %d pixels", w, h);
    std::longjmp(err.jump, 1);
  }
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = pixels + static_cast<std::size_t>(cinfo.output_scanline) * w * 3;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  std::unique_ptr<std::uint8_t, decltype(&std::free)> owned(pixels, &std::free);
  return to_planes(owned.get(), h, w);
}

// ---- PNG ------------------------------------------------------------------------------------

struct PngError {
  std::jmp_buf jump;
  char message[256];
};

void png_fail(png_structp png, png_const_charp msg) {
  auto* e = static_cast<PngError*>(png_get_error_ptr(png));
  std::snprintf(e->message, sizeof e->message, "%s", msg);
  std::longjmp(e->jump, 1);
}

void png_warn(png_structp, png_const_charp) {}  // benign (e.g. an unknown chunk): read on

DecodedImage decode_png(std::FILE* f, const std::string& what, std::int64_t max_pixels) {
  PngError err;
  err.message[0] = '\0';
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &err, png_fail, png_warn);
  if (png == nullptr) fail_user("{}: libpng could not start", what);
  png_infop info = png_create_info_struct(png);
  std::uint8_t* volatile pixels = nullptr;  // [h, w, 3]
  png_bytep* volatile rows = nullptr;       // [h] into pixels
  char refusal[160] = "";
  if (setjmp(err.jump)) {
    png_destroy_read_struct(&png, &info, nullptr);
    std::free(pixels);
    std::free(rows);
    if (refusal[0] != '\0') fail_user("{}: {}", what, refusal);
    fail_user("{}: not a readable PNG file: {}", what, err.message);
  }
  if (info == nullptr) png_error(png, "out of memory");
  png_init_io(png, f);
  png_read_info(png, info);
  const png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  if (static_cast<std::int64_t>(w) * h > max_pixels) {
    std::snprintf(refusal, sizeof refusal, "%u x %u pixels, more than the %lld an image may have",
                  w, h, static_cast<long long>(max_pixels));
    std::longjmp(err.jump, 1);
  }
  // To 8-bit RGB: palette and low-depth gray expanded, 16 bits to the high byte, gray
  // replicated, alpha (and tRNS) dropped.
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_gray_to_rgb(png);
  png_set_strip_alpha(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != static_cast<png_size_t>(w) * 3)
    png_error(png, "unexpected row layout after the conversion to 8-bit RGB");
  pixels = static_cast<std::uint8_t*>(std::malloc(static_cast<std::size_t>(h) * w * 3));
  rows = static_cast<png_bytep*>(std::malloc(sizeof(png_bytep) * h));
  if (pixels == nullptr || rows == nullptr) png_error(png, "out of memory");
  for (png_uint_32 y = 0; y < h; ++y) rows[y] = pixels + static_cast<std::size_t>(y) * w * 3;
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  std::free(rows);
  std::unique_ptr<std::uint8_t, decltype(&std::free)> owned(pixels, &std::free);
  return to_planes(owned.get(), static_cast<int>(h), static_cast<int>(w));
}

}  // namespace

DecodedImage decode_image(const std::string& path, const std::string& what, std::int64_t max_pixels) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) fail_user("{}: cannot open {}: {}", what, path, std::strerror(errno));
  unsigned char magic[8] = {};
  const std::size_t n = std::fread(magic, 1, sizeof magic, f.get());
  std::rewind(f.get());
  if (n >= 3 && magic[0] == 0xFF && magic[1] == 0xD8 && magic[2] == 0xFF)
    return decode_jpeg(f.get(), what, max_pixels);
  if (n == 8 && png_sig_cmp(magic, 0, 8) == 0) return decode_png(f.get(), what, max_pixels);
  fail_user("{}: {} is neither a JPEG nor a PNG file (by its first bytes)", what, path);
}

}  // namespace qt
