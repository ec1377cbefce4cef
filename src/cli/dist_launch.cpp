// The local launcher of `fastattn train --nproc N` (dist_launch.h): fork/exec
// of /proc/self/exe with the rendezvous environment, and a wait loop that
// stops the whole group when one worker fails.
#include "cli/dist_launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"

namespace fastattn::cli {
namespace {

volatile std::sig_atomic_t g_forward = 0;  // a signal to pass on to the workers
void on_launcher_signal(int sig) { g_forward = sig; }

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// A TCP port free on loopback now (the kernel's pick). Another program could
// take it before rank 0 binds it; the rendezvous then fails with a clear error.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("--nproc: socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("--nproc: cannot find a free port on 127.0.0.1: " + err);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

int64_t cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = strsignal(WTERMSIG(status));
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + (name ? name : "?") +
           ")";
  }
  return "stopped (status " + std::to_string(status) + ")";
}

}  // namespace

int launch_local_workers(int64_t nproc) {
  if (nproc < 1) throw UsageError("--nproc must be >= 1, got " + std::to_string(nproc));
  if (const char* ws = std::getenv("WORLD_SIZE"); ws != nullptr && *ws != '\0') {
    throw UsageError(std::string("--nproc starts its own workers, but WORLD_SIZE=") + ws +
                     " is already set (started by torchrun or a scheduler?); drop --nproc");
  }
  // The workers' command line: ours without --nproc, with --threads
  // cores/N unless the user chose.
  auto argv = own_command_line();
  if (argv.empty()) throw std::runtime_error("--nproc: cannot read /proc/self/cmdline");
  std::vector<std::string> child;
  bool threads_given = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const auto& a = argv[i];
    if (i > 0 && a == "--nproc") {
      ++i;
      continue;
    }
    if (i > 0 && a.rfind("--nproc=", 0) == 0) continue;
    if (a == "--threads" || a.rfind("--threads=", 0) == 0) threads_given = true;
    child.push_back(a);
  }
  if (!threads_given) {
    child.push_back("--threads");
    child.push_back(std::to_string(std::max<int64_t>(1, cores() / nproc)));
  }
  const int port = free_port();
  write_stderr("train: starting " + std::to_string(nproc) +
               " worker processes (rendezvous 127.0.0.1:" + std::to_string(port) + ")\n");

  // The terminal's Ctrl-C reaches the workers directly (same process group):
  // they checkpoint and exit 130; the launcher only waits. SIGTERM is passed on.
  // No SA_RESTART: a SIGTERM must interrupt the blocking waitpid below.
  struct sigaction ignore {
  }, forward{}, old_int{}, old_term{};
  ignore.sa_handler = SIG_IGN;
  forward.sa_handler = on_launcher_signal;
  ::sigaction(SIGINT, &ignore, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  std::vector<pid_t> pids;
  for (int64_t r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      throw std::runtime_error(std::string("--nproc: fork failed: ") + std::strerror(errno));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphans if the launcher dies
      std::signal(SIGINT, SIG_DFL);
      std::signal(SIGTERM, SIG_DFL);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> cargv;
      for (auto& s : child) cargv.push_back(s.data());
      cargv.push_back(nullptr);
      ::execv("/proc/self/exe", cargv.data());
      std::fprintf(stderr, "fastattn: --nproc: cannot start a worker: %s\n", std::strerror(errno));
      std::_Exit(127);
    }
    pids.push_back(pid);
  }

  std::vector<bool> alive(pids.size(), true);
  size_t running = pids.size();
  int result = 0;
  bool failed = false, all_interrupted = true;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    if (g_forward) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (alive[r]) ::kill(pids[r], g_forward);
      }
      g_forward = 0;
    }
    if (failed && std::chrono::steady_clock::now() >= deadline) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (alive[r]) {
          write_stderr("train: stopping worker rank " + std::to_string(r) + "\n");
          ::kill(pids[r], SIGKILL);
        }
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, failed ? WNOHANG : 0);
    if (pid == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: nothing left
    }
    const auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const size_t r = static_cast<size_t>(it - pids.begin());
    alive[r] = false;
    --running;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    const bool interrupted = WIFEXITED(status) && WEXITSTATUS(status) == 130;
    all_interrupted = all_interrupted && interrupted;
    if (!ok && !interrupted && !failed) {
      failed = true;
      result = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      write_stderr("train: worker rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                   ") " + describe(status) + "; stopping the other workers\n");
      // A few seconds for the others to report their own error, then SIGKILL.
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (failed) return result == 0 ? 1 : result;
  return all_interrupted ? 130 : 0;
}

}  // namespace fastattn::cli
