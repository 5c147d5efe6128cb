// A one-line progress bar on stderr for long store transfers, drawn only when stderr is a
// terminal (never in logs or pipes) and at most a few times per second.
#pragma once
#include <cstdint>
#include <string>

#include "store/store.hpp"

namespace deltasync::cli {

// A ProgressFn that draws "LABEL [#####     ]  42%  12.3 MB / 29.1 MB" on a TTY, or an empty
// function when stderr is not a terminal or `quiet`.
ProgressFn terminal_progress(const std::string& label, bool quiet);
// Ends the bar's line if one was drawn.
void finish_progress();

}  // namespace deltasync::cli
