// deltasync command-line entry: dispatches to the registered subcommands. Every failure ends
// as one line on stderr ("deltasync: ...") and a non-zero exit.
#include <cstdio>
#include <cstring>
#include <exception>

#include "command.hpp"

namespace deltasync::cli {

namespace {
std::vector<Command>& registry() {
  static std::vector<Command> all;
  return all;
}
}  // namespace

bool register_command(const Command& command) {
  registry().push_back(command);
  return true;
}
const std::vector<Command>& commands() { return registry(); }

}  // namespace deltasync::cli

namespace {
void print_usage(FILE* out) {
  std::fprintf(out, "usage: deltasync COMMAND ...\n");
  for (const auto& c : deltasync::cli::commands()) std::fprintf(out, "  deltasync %s\n", c.usage);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : deltasync::cli::commands()) {
    if (std::strcmp(c.name, argv[1]) != 0) continue;
    try {
      return c.run(deltasync::cli::Args(argv + 2, argv + argc));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltasync %s: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "deltasync: unknown command '%s'\n", argv[1]);
  print_usage(stderr);
  return 2;
}
