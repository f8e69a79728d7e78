// The k3 tool's SHA-256 (its checksums of result bytes) against the FIPS 180-2 example
// digests, fed whole and in uneven pieces across block boundaries.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "../../examples/k3/sha256.hpp"

namespace {

std::string digest(std::string const& m, std::size_t piece) {
  k3::cli::sha256 h;
  for (std::size_t i = 0; i < m.size(); i += piece) h.update(m.data() + i, std::min(piece, m.size() - i));
  return h.hex();
}

}  // namespace

TEST_CASE("sha256: FIPS 180-2 digests, whole and in pieces") {
  struct vec {
    std::string msg, hex;
  };
  vec const v[] = {{"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
                   {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
                   {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
                   {std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"}};
  for (auto const& t : v) {
    CAPTURE(t.msg.size());
    for (std::size_t piece : {std::size_t(1), std::size_t(7), std::size_t(64), std::size_t(333), std::size_t(1) << 20})
      CHECK(digest(t.msg, piece) == t.hex);
  }
  // 55, 56 and 64 bytes (digests from Python's hashlib): the length field fits the last block,
  // needs another one, follows a full block.
  CHECK(digest(std::string(55, 'x'), 9) == "d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072");
  CHECK(digest(std::string(56, 'x'), 9) == "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e");
  CHECK(digest(std::string(64, 'x'), 9) == "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c");
}
