// examples/k3/option_names.hpp — library errors in the CLI's spelling. The library names its
// options as C++ fields or parameters ("option 'gate_lower_bound'", "argument 'ema'"); the user
// of `k3` typed --gate-lower-bound, so errors that reach the tool name the option as typed.
// Every command leaves the checks of its option values to the library and runs through this.
#pragma once
#include <initializer_list>
#include <string>
#include <utility>

#include "cli.hpp"
#include "k3/core/error.hpp"

namespace k3::cli {

// Runs f(); a k3::error it throws is rethrown with every "option '<field>'" and
// "argument '<field>'" replaced by "option '--<flag>'" for the (field, flag) pairs given. An
// error about one of these options (the message starts with it) is a bad option value, i.e.
// a usage error (exit 2); one that only mentions it (an input that breaks the promise an
// option makes, say) stays a k3::error.
template <class F>
auto with_option_spellings(std::initializer_list<std::pair<char const*, char const*>> names, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (k3::error const& e) {
    std::string m = e.what();
    if (m.rfind("k3: ", 0) == 0) m.erase(0, 4);  // k3::error adds it again
    bool changed = false, about_option = false;
    for (auto const& [field, flag] : names) {
      std::string const to = std::string("option '--") + flag + "'";
      for (char const* kind : {"option '", "argument '"}) {
        std::string const from = kind + std::string(field) + "'";
        for (std::size_t at = m.find(from); at != std::string::npos; at = m.find(from, at + to.size())) {
          m.replace(at, from.size(), to);
          changed = true;
          about_option = about_option || at == 0;
        }
      }
    }
    if (!changed) throw;
    if (about_option) throw usage_error(m);
    throw k3::error(m);
  }
}

}  // namespace k3::cli
