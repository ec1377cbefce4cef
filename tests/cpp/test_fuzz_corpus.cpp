// Replays the operator fuzzer's regression corpus (fuzz/corpus/) through the
// same decoding and checks as the libFuzzer harness (fuzz/fuzz_ops.cpp), so
// that `make test` covers every case the fuzzer found interesting. Also runs
// a fixed batch of pseudo-random inputs for every operator choice.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

#include "../../fuzz/fuzz_ops.h"

#ifndef FASTATTN_FUZZ_CORPUS_DIR
#error "FASTATTN_FUZZ_CORPUS_DIR must name fuzz/corpus"
#endif

namespace {

std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(FuzzCorpus, EveryCorpusFilePasses) {
  const std::filesystem::path dir = FASTATTN_FUZZ_CORPUS_DIR;
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const auto bytes = read_bytes(entry.path());
    EXPECT_EQ(fastattn::fuzz::check_fuzz_input(bytes.data(), bytes.size()), "")
        << entry.path().filename();
    ++files;
  }
  EXPECT_GT(files, 0);
}

TEST(FuzzCorpus, SeededRandomInputsPerOperator) {
  std::mt19937 gen(12345);
  for (int op = 0; op < fastattn::fuzz::fuzz_op_count(); ++op) {
    for (int rep = 0; rep < 40; ++rep) {
      std::vector<uint8_t> bytes(64 + gen() % 512);
      for (auto& x : bytes) x = static_cast<uint8_t>(gen());
      bytes[0] = static_cast<uint8_t>(op);
      EXPECT_EQ(fastattn::fuzz::check_fuzz_input(bytes.data(), bytes.size()), "")
          << fastattn::fuzz::fuzz_op_name(op) << " rep " << rep;
    }
  }
}

}  // namespace
