// The `sparsetrain` command: sub-commands over the library (demo, info), each with --help.
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"
#include "tools/commands.h"

namespace {

const char* kUsage =
    "usage: sparsetrain <command> [options]\n"
    "\n"
    "Training kernels for MoE layers and block-sparse attention.\n"
    "\n"
    "commands:\n"
    "  demo    check GroupedLinear, GroupedMLP and block-sparse attention (forward and backward)\n"
    "          against double-precision oracles on the best available backend, then run one MoE\n"
    "          transformer block training step twice and check it is bitwise deterministic\n"
    "  info    print the build configuration and the devices this machine offers\n"
    "\n"
    "options:\n"
    "  --version    print the version\n"
    "  --help       this text\n"
    "\n"
    "Run `sparsetrain <command> --help` for the options of a command.\n";

int run_info(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf("usage: sparsetrain info\n\nPrints the version, whether the CUDA backend was built, "
                  "the CUDA devices found and the backend operations run on.\n");
      return 0;
    }
    std::fprintf(stderr, "sparsetrain info: unknown option '%s' (try --help)\n", argv[i]);
    return 2;
  }
  std::printf("sparsetrain %s\n", sparsetrain::version());
  std::printf("CUDA backend built: %s\n", sparsetrain::built_with_cuda() ? "yes" : "no");
  if (sparsetrain::built_with_cuda()) {
    std::printf("generic kernels:    %s (SASS for each, PTX for the last)\n", sparsetrain::cuda_archs());
    std::printf("sm_90a kernels:     %s\n", sparsetrain::sm90_kernel_set());
  }
  std::printf("CUDA devices:       %d\n", sparsetrain::cuda_device_count());
  std::printf("best backend:       %s\n", sparsetrain::best_backend_description().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool help = argc >= 2 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"));
  if ((help || (argc >= 2 && !std::strcmp(argv[1], "--version"))) && argc > 2) {
    std::fprintf(stderr, "sparsetrain: %s takes no arguments, got '%s'\n", argv[1], argv[2]);
    return 2;
  }
  if (argc < 2 || help) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("sparsetrain %s\n", sparsetrain::version());
    return 0;
  }
  try {
    const std::string cmd = argv[1];
    if (cmd == "demo") return sparsetrain::tools::run_demo(argc, argv);
    if (cmd == "info") return run_info(argc, argv);
    std::fprintf(stderr, "sparsetrain: unknown command '%s'\n\n%s", argv[1], kUsage);
    return 2;
  } catch (const sparsetrain::Error& e) {
    std::fprintf(stderr, "sparsetrain: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "sparsetrain: error: out of host memory\n");
    return 1;
  }
}
