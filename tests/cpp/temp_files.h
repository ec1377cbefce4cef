// Test helpers for files: a scratch directory removed at the end of the
// test, and whole-file reads and writes.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace fastattn::testing {

// A fresh directory /tmp/fastattn_<tag>_XXXXXX, removed with its contents
// when the object goes out of scope.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag = "test") {
    std::string pattern = "/tmp/fastattn_" + tag + "_XXXXXX";
    const char* made = ::mkdtemp(pattern.data());
    path = made ? made : "";
  }
  ~TempDir() {
    if (!path.empty()) std::system(("rm -rf '" + path + "'").c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace fastattn::testing
