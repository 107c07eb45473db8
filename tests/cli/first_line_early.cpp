// Runs a command with its stdout on a pipe and checks that its first line arrives while it still
// has work to do: at least MIN_MS milliseconds before the end of its output. A program whose stdout
// is fully buffered (C's default on a pipe) delivers every line at exit, a gap of about 0 ms.
// usage: first_line_early MIN_MS COMMAND [ARGS...]; exit 0 on success, 1 otherwise.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: first_line_early MIN_MS COMMAND [ARGS...]\n");
    return 1;
  }
  const double min_ms = std::atof(argv[1]);
  std::string cmd;
  for (int i = 2; i < argc; ++i) {  // each argument single-quoted for the shell
    cmd += " '";
    for (const char* c = argv[i]; *c; ++c) cmd += *c == '\'' ? std::string("'\\''") : std::string(1, *c);
    cmd += "'";
  }
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    std::fprintf(stderr, "first_line_early: cannot run%s\n", cmd.c_str());
    return 1;
  }
  using Clock = std::chrono::steady_clock;
  std::string first, rest;
  Clock::time_point first_at{};
  for (int ch; (ch = std::fgetc(pipe)) != EOF;) {
    if (first_at == Clock::time_point{}) {
      first += char(ch);
      if (ch == '\n') first_at = Clock::now();
    } else {
      rest += char(ch);
    }
  }
  const Clock::time_point end_at = Clock::now();
  const int status = pclose(pipe);
  if (first_at == Clock::time_point{}) {
    std::fprintf(stderr, "first_line_early: no complete line from%s (exit status %d)\n", cmd.c_str(), status);
    return 1;
  }
  const double gap_ms = std::chrono::duration<double, std::milli>(end_at - first_at).count();
  std::printf("first line %.1f ms before the end of the output: %s", gap_ms, first.c_str());
  if (status != 0 || gap_ms < min_ms) {
    std::fprintf(stderr, "first_line_early: %s (exit status %d, wanted a gap of >= %.0f ms)\n%s%s",
                 status != 0 ? "the command failed" : "the first line came with the rest, at exit", status, min_ms,
                 first.c_str(), rest.c_str());
    return 1;
  }
  return 0;
}
