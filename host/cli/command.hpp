// Subcommands register themselves (one .cpp per command), so main.cpp never changes when a
// command is added.
#pragma once
#include <string>
#include <vector>

namespace deltasync::cli {

using Args = std::vector<std::string>;  // arguments after the subcommand name

struct Command {
  const char* name;
  const char* usage;    // one line: "diff BASE NEW -o DELTA [--model-version N]"
  int (*run)(const Args& args);  // returns the exit code; may throw deltasync::Error
};

// Called from a static initializer in each command's file:
//   static const bool registered = register_command({"diff", "...", &run_diff});
bool register_command(const Command& command);
const std::vector<Command>& commands();

}  // namespace deltasync::cli
