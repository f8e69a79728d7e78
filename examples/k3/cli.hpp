// The k3 command-line tool's framework: option parsing, the subcommand registry, and .npy
// argument loading. Each subcommand lives in its own cmd_<op>.cpp and registers itself with
// a static `k3::cli::registrar`. Any k3::error (or other exception) becomes one line on stderr
// and exit status 1; usage errors exit 2.
#pragma once
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "k3/io/npy.hpp"

namespace k3::cli {

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws k3::error(kind, make()) when `ok` is false: the tool's own checks of its inputs report
// like the library's, with the message built only on failure.
template <class MakeMessage>
  requires std::is_invocable_v<MakeMessage>
void check(bool ok, k3::error_kind kind, MakeMessage&& make) {
  if (!ok) throw k3::error(kind, make());
}

// Runs f(). A k3::error about one of the library's options or arguments that this command sets
// from a flag (a (field, flag) pair given, matched against error::argument()) is a bad value
// of that flag: a usage error (exit 2) that names the flag and says what the library said about
// the value (error::detail()). An input that breaks the promise of such a flag (error::related())
// stays an error of the input, and says which flag made the promise. Any other error passes
// through as it is.
template <class F>
auto with_option_spellings(std::initializer_list<std::pair<char const*, char const*>> names, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (k3::error const& e) {
    for (auto const& [field, flag] : names)
      if (e.argument() == field) throw usage_error("option '--" + std::string(flag) + "'" + std::string(e.detail()));
    for (auto const& [field, flag] : names)
      if (e.related() == field && !e.argument().empty())
        throw k3::error(e.kind(), e.subject() + " '" + e.argument() + "' breaks the promise of --" + flag + std::string(e.detail()));
    throw;
  }
}

struct option_spec {
  std::string name;      // without the leading "--"
  bool takes_value;      // --name VALUE, or a flag
  std::string help;
};

class args;

struct command {
  std::string name;
  std::string summary;
  std::string description;   // printed by `k3 <op> --help`
  std::vector<option_spec> options;
  bool needs_io = true;      // requires --in and --out
  int (*run)(args&) = nullptr;
};

inline std::vector<command>& registry() {
  static std::vector<command> r;
  return r;
}

struct registrar {
  explicit registrar(command c) { registry().push_back(std::move(c)); }
};

class args {
 public:
  args(command const& cmd, std::vector<std::string> const& argv) : cmd_(cmd) {
    for (std::size_t i = 0; i < argv.size(); ++i) {
      std::string const& a = argv[i];
      if (a.rfind("--", 0) != 0) throw usage_error("unexpected argument '" + a + "'");
      std::string name = a.substr(2), value;
      bool has_inline = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_inline = true;
      }
      option_spec const* spec = find(name);
      if (!spec) throw usage_error("unknown option '--" + name + "' for 'k3 " + cmd.name + "' (see k3 " + cmd.name + " --help)");
      // A repeated option is a mistake (which one was meant?), not "the last one wins".
      if (values_.count(name) || flags_.count(name)) throw usage_error("option '--" + name + "' given more than once");
      if (spec->takes_value) {
        if (!has_inline) {
          if (i + 1 >= argv.size()) throw usage_error("option '--" + name + "' needs a value");
          value = argv[++i];
        }
        values_[name] = value;
      } else {
        if (has_inline) throw usage_error("option '--" + name + "' takes no value");
        flags_[name] = true;
      }
    }
    if (cmd.needs_io) {
      if (!has("in")) throw usage_error("missing --in DIR");
      if (!has("out")) throw usage_error("missing --out DIR");
      if (!std::filesystem::is_directory(value("in"))) throw usage_error("--in '" + value("in") + "' is not a directory");
      if (std::filesystem::exists(value("out")) && !std::filesystem::is_directory(value("out")))
        throw usage_error("--out '" + value("out") + "' exists and is not a directory");
      std::filesystem::create_directories(value("out"));
    }
  }

  bool has(std::string const& name) const { return values_.count(name) != 0; }
  bool flag(std::string const& name) const { return flags_.count(name) != 0; }
  std::string value(std::string const& name, std::string const& def = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? def : it->second;
  }
  double number(std::string const& name, double def) const {
    if (!has(name)) return def;
    try {
      std::size_t pos = 0;
      double v = std::stod(value(name), &pos);
      if (pos != value(name).size()) throw std::invalid_argument("");
      return v;
    } catch (std::exception const&) {
      throw usage_error("option '--" + name + "' expects a number, got '" + value(name) + "'");
    }
  }
  std::int64_t integer(std::string const& name, std::int64_t def) const {
    if (!has(name)) return def;
    try {
      std::size_t pos = 0;
      long long v = std::stoll(value(name), &pos);
      if (pos != value(name).size()) throw std::invalid_argument("");
      return v;
    } catch (std::exception const&) {
      throw usage_error("option '--" + name + "' expects an integer, got '" + value(name) + "'");
    }
  }
  // An integer option that must lie in [lo, hi].
  std::int64_t integer_in(std::string const& name, std::int64_t def, std::int64_t lo, std::int64_t hi) const {
    std::int64_t const v = integer(name, def);
    if (v < lo || v > hi)
      throw usage_error("option '--" + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                        std::to_string(v));
    return v;
  }
  // --threads: 0 means one per hardware thread; capped, since each one is a started thread.
  int threads(std::int64_t def) const { return static_cast<int>(integer_in("threads", def, 0, max_threads)); }
  static constexpr std::int64_t max_threads = 1024;
  std::string choice(std::string const& name, std::vector<std::string> const& allowed) const {
    std::string v = value(name, allowed.front());
    for (auto const& a : allowed)
      if (a == v) return v;
    std::string list;
    for (auto const& a : allowed) list += (list.empty() ? "" : "|") + a;
    throw usage_error("option '--" + name + "' must be one of " + list + ", got '" + v + "'");
  }

  std::string in_path(std::string const& name) const { return (std::filesystem::path(value("in")) / (name + ".npy")).string(); }
  std::string out_path(std::string const& name) const { return (std::filesystem::path(value("out")) / (name + ".npy")).string(); }

  // Required input <in>/<name>.npy.
  io::npy_array load(std::string const& name) const {
    std::string p = in_path(name);
    if (!std::filesystem::exists(p)) throw k3::error(k3::error_kind::io, "missing input '" + name + ".npy' in " + value("in"));
    return io::read_npy(p);
  }
  std::optional<io::npy_array> load_optional(std::string const& name) const {
    if (!std::filesystem::exists(in_path(name))) return std::nullopt;
    return io::read_npy(in_path(name));
  }
  template <class T, std::size_t R>
  void save(std::string const& name, tensor_view<T, R> v) const {
    io::write_npy(out_path(name), v);
  }

 private:
  option_spec const* find(std::string const& name) const {
    for (auto const& o : cmd_.options)
      if (o.name == name) return &o;
    return nullptr;
  }
  command const& cmd_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> flags_;
};

// Elements of an output of the given shape. Inputs of size 0 can declare extents whose product
// overflows int64 (e.g. q [1, 0, 1, 2^32] and v [1, 0, 1, 2^32] make a state K x V = 2^64):
// refuse those instead of allocating a wrapped-around size and writing past it.
inline index_t output_elements(std::string const& name, std::vector<index_t> const& shape) {
  index_t n = 1;
  for (index_t e : shape)
    if (e < 0 || __builtin_mul_overflow(n, e, &n))
      throw k3::error(k3::error_kind::shape, "output '" + name + "': shape " + k3::format_shape(shape) + " has more elements than can be addressed");
  return n;
}

// The options every op that reads and writes .npy directories takes.
inline std::vector<option_spec> io_options(std::vector<option_spec> more = {}) {
  std::vector<option_spec> o = {{"in", true, "directory holding the input .npy files"},
                                {"out", true, "directory to write the output .npy files to (created)"},
                                {"help", false, "show this help"}};
  o.insert(o.end(), more.begin(), more.end());
  return o;
}

}  // namespace k3::cli
