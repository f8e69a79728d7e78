// k3/core/error.hpp — the exception every host entry point throws on bad input, and the
// helpers that build messages naming the argument and the expected vs actual shape.
#pragma once
#include <cctype>
#include <charconv>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace k3 {

// What kind of input an error rejects: callers (the `k3` tool, a test, a retry loop) branch on
// it instead of on message text.
enum class error_kind : unsigned char {
  shape,        // extents, rank, strides, lengths that do not fit together
  dtype,        // an element type the op does not take
  value,        // a value out of range, non-finite, or breaking a promise an option makes
  aliasing,     // outputs overlapping inputs, other outputs or themselves
  io,           // files and messages: unreadable, malformed, failed writes, transport failures
  unsupported,  // a valid request this build or backend cannot serve
};

constexpr char const* error_kind_name(error_kind k) noexcept {
  switch (k) {
    case error_kind::shape: return "shape";
    case error_kind::dtype: return "dtype";
    case error_kind::value: return "value";
    case error_kind::aliasing: return "aliasing";
    case error_kind::io: return "io";
    case error_kind::unsupported: return "unsupported";
  }
  return "unknown";
}

// Bad input to a host entry point. Messages open with what they are about, as k3 spells it:
// "argument 'q': ...", "option 'chunk_size' ...", "output 'o' ...", "arguments 'o' and 'q'
// overlap ...", perhaps after the operation's name ("eplb: argument 'gpus' ..."); that name is
// argument() and the rest of the message is detail(), so a caller can name the argument its own
// way ("--chunk-size") without editing the text. Messages about no single argument (a
// collective's failure, a config) have an empty argument().
class error : public std::invalid_argument {
 public:
  // `related`: an option whose promise the input breaks (a g below options::gate_lower_bound),
  // for callers that name options their own way; empty when there is none.
  error(error_kind kind, std::string const& message, std::string related = {})
      : std::invalid_argument("k3: " + message), kind_(kind), related_(std::move(related)) {
    struct opening {
      std::string_view text, subject;
      bool plural;  // "arguments 'a' and 'b' overlap": the detail is the whole message
    };
    // An operation's name may come first ("eplb: argument 'gpus' ..."): one word of identifier
    // characters and "::" followed by ": ".
    std::size_t at = 0;
    while (at < message.size() && (std::isalnum(static_cast<unsigned char>(message[at])) || message[at] == '_' || message[at] == ':')) ++at;
    at = at > 2 && message.compare(at - 1, 2, ": ") == 0 ? at + 1 : 0;
    for (opening o : {opening{"argument '", "argument", false}, opening{"arguments '", "argument", true}, opening{"option '", "option", false},
                      opening{"options '", "option", true}, opening{"output '", "output", false}, opening{"input '", "input", false}}) {
      if (message.compare(at, o.text.size(), o.text) != 0) continue;
      auto const close = message.find('\'', at + o.text.size());
      if (close == std::string::npos) break;
      argument_ = message.substr(at + o.text.size(), close - at - o.text.size());
      subject_ = o.subject;
      detail_at_ = o.plural ? 0 : close + 1;
      break;
    }
  }

  error_kind kind() const noexcept { return kind_; }
  // The argument (or option, or output) the message opens with, as the C++ API names it.
  std::string const& argument() const noexcept { return argument_; }
  // The option whose promise the argument breaks, or empty.
  std::string const& related() const noexcept { return related_; }
  // "argument", "option", "output", "input" (the opening's first word), or empty.
  std::string const& subject() const noexcept { return subject_; }
  // The message without "k3: ".
  std::string_view message() const noexcept { return std::string_view(what()).substr(4); }
  // What the message says after the name it opens with (": expected shape [2], got [3]" for
  // "argument 'q': expected shape [2], got [3]"); the whole message when no single name opens it.
  std::string_view detail() const noexcept { return message().substr(detail_at_); }

 private:
  error_kind kind_;
  std::string argument_, subject_, related_;
  std::size_t detail_at_ = 0;
};

// How k3 messages print shapes ("[2, 3, 4]") and numbers; public so that callers composing
// their own messages spell them the same way.
template <class Range>
std::string format_shape(Range const& r) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto v : r) {
    if (!first) os << ", ";
    os << v;
    first = false;
  }
  os << ']';
  return os.str();
}

inline std::string format_shape(std::initializer_list<std::int64_t> r) {
  return format_shape<std::initializer_list<std::int64_t>>(r);
}

// The shortest text that reads back as x, in x's own type ("%g" wrote a gate one ulp below the
// bound -5 as "-5", std::to_string wrote 1e-9 as "0.000000").
template <class Real>
  requires std::is_floating_point_v<Real>
std::string format_number(Real x) {
  char buf[64];
  auto const r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

namespace detail {

using ::k3::format_number;
using ::k3::format_shape;

// The exception f() throws, or null: for argument checks whose failure one process of a
// collective must report to the others before throwing it (every rank then throws instead of
// some of them waiting in the collective).
template <class F>
std::exception_ptr capture_error(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// Throws k3::error when `cond` is false; the message is built only on failure.
template <class MakeMessage>
  requires std::is_invocable_v<MakeMessage>
inline void require(bool cond, error_kind kind, MakeMessage&& make) {
  if (!cond) throw ::k3::error(kind, make());
}

inline void require(bool cond, error_kind kind, std::string_view message) {
  if (!cond) throw ::k3::error(kind, std::string(message));
}

}  // namespace detail
}  // namespace k3
