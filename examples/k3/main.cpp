// k3 — replay tensors through k3 ops from the command line:
//   k3 <op> --in DIR --out DIR [options]
// Inputs are .npy files named after the op's arguments; outputs are written the same way.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "cli.hpp"

namespace {

void print_help() {
  std::cout << "usage: k3 <op> --in DIR --out DIR [options]\n"
               "       k3 <op> --help   (or k3 help <op>)\n"
               "       k3 version\n\n"
               "Reads the op's arguments as DIR/<name>.npy and writes its results as .npy files.\n\n"
               "ops:\n";
  auto cmds = k3::cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto const& a, auto const& b) { return a.name < b.name; });
  for (auto const& c : cmds) std::printf("  %-10s %s\n", c.name.c_str(), c.summary.c_str());
}

void print_command_help(k3::cli::command const& c) {
  std::cout << "usage: k3 " << c.name << (c.needs_io ? " --in DIR --out DIR" : "") << " [options]\n\n"
            << c.summary << "\n";
  if (!c.description.empty()) std::cout << "\n" << c.description << "\n";
  std::cout << "\noptions:\n";
  for (auto const& o : c.options) {
    std::string lhs = "--" + o.name + (o.takes_value ? " VALUE" : "");
    std::printf("  %-22s %s\n", lhs.c_str(), o.help.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  bool const help_word = !a.empty() && (a[0] == "--help" || a[0] == "-h" || a[0] == "help");
  if (a.empty() || (help_word && a.size() == 1)) {
    print_help();
    return a.empty() ? 2 : 0;
  }
  // `k3 help <op>` (and `k3 --help <op>`) is `k3 <op> --help`.
  if (help_word) a = {a[1], "--help"};
  if (a[0] == "--version") a[0] = "version";  // the usual spelling works too
  auto const& cmds = k3::cli::registry();
  auto it = std::find_if(cmds.begin(), cmds.end(), [&](auto const& c) { return c.name == a[0]; });
  if (it == cmds.end()) {
    std::cerr << "k3: unknown op '" << a[0] << "' (see k3 --help)\n";
    return 2;
  }
  std::vector<std::string> rest(a.begin() + 1, a.end());
  if (std::find(rest.begin(), rest.end(), "--help") != rest.end() ||
      std::find(rest.begin(), rest.end(), "-h") != rest.end()) {
    print_command_help(*it);
    return 0;
  }
  try {
    k3::cli::args parsed(*it, rest);
    return it->run(parsed);
  } catch (k3::cli::usage_error const& e) {
    std::cerr << "k3 " << it->name << ": " << e.what() << "\n";
    return 2;
  } catch (std::bad_alloc const&) {
    // Consistent but absurd shapes (e.g. a zero-token input declaring 2^34 experts, whose
    // outputs must still be written) can need more memory than there is.
    std::cerr << "k3 " << it->name << ": out of memory: the input shapes need more memory than is available\n";
    return 1;
  } catch (std::exception const& e) {
    std::string msg = e.what();
    if (msg.rfind("k3: ", 0) == 0) msg = msg.substr(4);
    std::cerr << "k3 " << it->name << ": " << msg << "\n";
    return 1;
  }
}
