// Measurement helpers for the CLI: fork-per-case runner, resident-memory
// high-water mark, timing and formatting. See measure.h for the method.
#include "cli/measure.h"

#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include <c10/util/Exception.h>

namespace fastattn::cli {

namespace {

bool write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::optional<int64_t> status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t klen = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, klen, key) == 0 && line.size() > klen && line[klen] == ':') {
      std::istringstream is(line.substr(klen + 1));
      int64_t kb = 0;
      if (is >> kb) return kb * 1024;
    }
  }
  return std::nullopt;
}

}  // namespace

nlohmann::json run_in_child(const std::function<nlohmann::json()>& fn) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  int fds[2];
  if (::pipe(fds) != 0) {
    return {{"error", std::string("pipe failed: ") + std::strerror(errno)}};
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {{"error", std::string("fork failed: ") + std::strerror(errno)}};
  }
  if (pid == 0) {
    ::close(fds[0]);
    nlohmann::json out;
    try {
      out = fn();
    } catch (const c10::Error& e) {
      out = {{"error", e.what_without_backtrace()}};
    } catch (const std::exception& e) {
      out = {{"error", e.what()}};
    }
    std::cout.flush();
    std::fflush(nullptr);
    const bool ok = write_all(fds[1], out.dump());
    ::close(fds[1]);
    ::_exit(ok ? 0 : 3);  // no static destructors: they belong to the parent
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return {{"error", "child process killed by signal " + std::to_string(sig) +
                          (sig == SIGKILL ? " (out of memory?)" : "")}};
  }
  if (text.empty()) {
    return {{"error", "child process exited with status " + std::to_string(WEXITSTATUS(status)) +
                          " and no result"}};
  }
  return nlohmann::json::parse(text);
}

std::optional<int64_t> reset_peak_rss() {
  malloc_trim(0);
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return std::nullopt;
  f << "5" << std::flush;
  if (!f) return std::nullopt;
  return status_kb("VmRSS");
}

std::optional<int64_t> peak_rss() { return status_kb("VmHWM"); }

std::optional<int64_t> measure_peak_growth(const std::function<void()>& fn) {
  const auto base = reset_peak_rss();
  fn();
  const auto peak = peak_rss();
  if (!base || !peak) return std::nullopt;
  return std::max<int64_t>(0, *peak - *base);
}

std::vector<double> time_ms(const std::function<void()>& fn, int64_t repeat, int64_t warmup) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  std::vector<double> out;
  for (int64_t i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    out.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return out;
}

std::pair<std::vector<double>, std::vector<double>> alternated_ms(const std::function<void()>& a,
                                                                  const std::function<void()>& b,
                                                                  int64_t repeat) {
  auto once = [](const std::function<void()>& fn) { return time_ms(fn, 1, 0).front(); };
  a();
  b();
  std::vector<double> ta, tb;
  for (int64_t i = 0; i < repeat; ++i) {
    if (i % 2 == 0) {
      ta.push_back(once(a));
      tb.push_back(once(b));
    } else {
      tb.push_back(once(b));
      ta.push_back(once(a));
    }
  }
  return {ta, tb};
}

double median(std::vector<double> xs) {
  if (xs.empty()) return 0.0;
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  return n % 2 == 1 ? xs[n / 2] : 0.5 * (xs[n / 2 - 1] + xs[n / 2]);
}

std::string format_fixed(double x, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, x);
  return buf;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return format_fixed(bytes, u == 0 ? 0 : 1) + " " + units[u];
}

}  // namespace fastattn::cli
