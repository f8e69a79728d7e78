// examples/k3/option_names.hpp — library errors in the CLI's spelling. The library names its
// options as C++ fields ("option 'gate_lower_bound'"); the user of `k3` typed
// --gate-lower-bound, so errors that reach the tool name the option as typed.
#pragma once
#include <initializer_list>
#include <string>
#include <utility>

#include "k3/core/error.hpp"

namespace k3::cli {

// Runs f(); a k3::error it throws is rethrown with every "option '<field>'" replaced by
// "option '--<flag>'" for the (field, flag) pairs given.
template <class F>
auto with_option_spellings(std::initializer_list<std::pair<char const*, char const*>> names, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (k3::error const& e) {
    std::string m = e.what();
    bool changed = false;
    for (auto const& [field, flag] : names) {
      std::string const from = std::string("option '") + field + "'", to = std::string("option '--") + flag + "'";
      for (std::size_t at = m.find(from); at != std::string::npos; at = m.find(from, at + to.size())) {
        m.replace(at, from.size(), to);
        changed = true;
      }
    }
    if (!changed) throw;
    if (m.rfind("k3: ", 0) == 0) m.erase(0, 4);  // k3::error adds it again
    throw k3::error(m);
  }
}

}  // namespace k3::cli
