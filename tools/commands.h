// Sub-commands of the `sparsetrain` tool. Each parses its own options (argv[2..]) and returns
// the process exit status: 0 success, 1 failure, 2 usage error.
#pragma once

namespace sparsetrain::tools {

int run_demo(int argc, char** argv);

}  // namespace sparsetrain::tools
