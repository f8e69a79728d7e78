// A small RGB canvas the k3 tool draws charts on, written as a PNG (stored deflate blocks, so
// no zlib): filled rectangles and text in a built-in 3x5 pixel font.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace k3::cli {

struct rgb {
  std::uint8_t r, g, b;
};

class canvas {
 public:
  canvas(int w, int h, rgb bg = {255, 255, 255}) : w_(w), h_(h), px_(static_cast<std::size_t>(w * h), bg) {}
  int width() const noexcept { return w_; }
  int height() const noexcept { return h_; }

  void fill(int x0, int y0, int x1, int y1, rgb c) {
    for (int y = std::max(0, y0); y < std::min(h_, y1); ++y)
      for (int x = std::max(0, x0); x < std::min(w_, x1); ++x) px_[static_cast<std::size_t>(y * w_ + x)] = c;
  }

  // Text at (x, y) (top left), each font pixel drawn as a scale x scale square. Letters are
  // drawn lower case; characters outside [0-9a-z .,:/()%+-x] are left blank.
  int text(int x, int y, std::string const& s, int scale = 2, rgb c = {0, 0, 0}) {
    for (char ch : s) {
      std::uint16_t const g = glyph(ch);
      for (int row = 0; row < 5; ++row)
        for (int col = 0; col < 3; ++col)
          if (g >> (14 - (row * 3 + col)) & 1) fill(x + col * scale, y + row * scale, x + (col + 1) * scale, y + (row + 1) * scale, c);
      x += 4 * scale;
    }
    return x;
  }

  void write_png(std::string const& path) const {
    std::vector<std::uint8_t> raw;
    raw.reserve(static_cast<std::size_t>(h_ * (1 + 3 * w_)));
    for (int y = 0; y < h_; ++y) {
      raw.push_back(0);  // filter: none
      for (int x = 0; x < w_; ++x) {
        rgb const& p = px_[static_cast<std::size_t>(y * w_ + x)];
        raw.insert(raw.end(), {p.r, p.g, p.b});
      }
    }
    std::vector<std::uint8_t> z = {0x78, 0x01};  // zlib header, stored blocks follow
    for (std::size_t pos = 0; pos < raw.size() || pos == 0;) {
      std::size_t const n = std::min<std::size_t>(65535, raw.size() - pos);
      bool const last = pos + n == raw.size();
      z.push_back(last ? 1 : 0);
      z.insert(z.end(), {std::uint8_t(n & 0xff), std::uint8_t(n >> 8), std::uint8_t(~n & 0xff), std::uint8_t((~n >> 8) & 0xff)});
      z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(pos), raw.begin() + static_cast<std::ptrdiff_t>(pos + n));
      pos += n;
      if (last) break;
    }
    std::uint32_t a = 1, b = 0;
    for (std::uint8_t v : raw) {
      a = (a + v) % 65521;
      b = (b + a) % 65521;
    }
    put32(z, (b << 16) | a);
    std::vector<std::uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    std::vector<std::uint8_t> ihdr;
    put32(ihdr, static_cast<std::uint32_t>(w_));
    put32(ihdr, static_cast<std::uint32_t>(h_));
    ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, no interlace
    chunk(out, "IHDR", ihdr);
    chunk(out, "IDAT", z);
    chunk(out, "IEND", {});
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write '" + path + "'");
    bool const ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
    if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write '" + path + "'");
  }

 private:
  static void put32(std::vector<std::uint8_t>& v, std::uint32_t x) {
    v.insert(v.end(), {std::uint8_t(x >> 24), std::uint8_t(x >> 16), std::uint8_t(x >> 8), std::uint8_t(x)});
  }
  static std::uint32_t crc32(std::vector<std::uint8_t> const& bytes) {
    std::uint32_t c = 0xffffffffu;
    for (std::uint8_t v : bytes) {
      c ^= v;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
  }
  static void chunk(std::vector<std::uint8_t>& out, char const* type, std::vector<std::uint8_t> const& data) {
    put32(out, static_cast<std::uint32_t>(data.size()));
    std::vector<std::uint8_t> td(type, type + 4);
    td.insert(td.end(), data.begin(), data.end());
    out.insert(out.end(), td.begin(), td.end());
    put32(out, crc32(td));
  }
  // 3x5 glyphs, row-major from the top, 15 bits.
  static std::uint16_t glyph(char ch) {
    static constexpr std::array<std::uint16_t, 36> alnum = {
        0b111101101101111, 0b010110010010111, 0b111001111100111, 0b111001111001111, 0b101101111001001,  // 0-4
        0b111100111001111, 0b111100111101111, 0b111001001001001, 0b111101111101111, 0b111101111001111,  // 5-9
        0b010101111101101, 0b110101110101110, 0b011100100100011, 0b110101101101110, 0b111100110100111,  // a-e
        0b111100110100100, 0b011100101101011, 0b101101111101101, 0b111010010010111, 0b001001001101010,  // f-j
        0b101101110101101, 0b100100100100111, 0b101111111101101, 0b110101101101101, 0b010101101101010,  // k-o
        0b110101110100100, 0b010101101110011, 0b110101110101101, 0b011100010001110, 0b111010010010010,  // p-t
        0b101101101101111, 0b101101101101010, 0b101101111111101, 0b101101010101101, 0b101101010010010,  // u-y
        0b111001010100111};                                                                              // z
    if (ch >= '0' && ch <= '9') return alnum[static_cast<std::size_t>(ch - '0')];
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
    if (ch >= 'a' && ch <= 'z') return alnum[static_cast<std::size_t>(10 + ch - 'a')];
    switch (ch) {
      case '.': return 0b000000000000010;
      case ',': return 0b000000000010100;
      case ':': return 0b000010000010000;
      case '/': return 0b001001010100100;
      case '(': return 0b010100100100010;
      case ')': return 0b010001001001010;
      case '%': return 0b101001010100101;
      case '+': return 0b000010111010000;
      case '-': return 0b000000111000000;
      default: return 0;
    }
  }

  int w_, h_;
  std::vector<rgb> px_;
};

}  // namespace k3::cli
