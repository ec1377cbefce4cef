// The fastattn operator fuzzer's decoding and checking, shared by the libFuzzer
// harness (fuzz/fuzz_main.cpp, clang, FASTATTN_FUZZ=ON) and the corpus replay
// test (tests/cpp/test_fuzz_corpus.cpp, the normal build).
//
// check_fuzz_input decodes bytes into an operator, small shapes (N <= 2,
// H <= 3, L, S <= 9, E <= 5, M <= 4, empty sizes included), parameters,
// masks, values (finite, magnitudes up to ~1e3 so that |q·k| reaches ~1e6),
// layouts (contiguous or not) and, sometimes, one deliberate corruption
// (a shape, dtype, range or parameter that the operator must reject).
// One choice, the registry operator with parameters at and past their
// ranges (ends, one past, huge, tiny, negative, unknown choices) and inputs
// scaled by up to 1e20, checks that out-of-range values are refused naming
// the parameter, that other refusals name the type or a parameter, and that
// outputs are finite (an "overflowed" refusal only near the dtype's range).
// It calls the operator and checks:
//   - a corrupted input raises a c10::Error; a valid one raises nothing;
//   - the output of a valid input is finite and has the promised shape;
//   - float64 outputs agree with the operator's plain-ATen reference
//     (fastattn::reference::*), or with the operator's invariants where it
//     has no reference (cluster_codes, clustered_topk_attention);
//   - gradients are finite, in float32 and float64, for every choice (the
//     registry operator with parameters at their limits may instead raise its
//     "overflowed" error where its forward could, naming the type; the
//     integer-valued clustering ops record none for inputs that require grad).
// Crashes and memory errors are the sanitizers' to report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastattn::fuzz {

// Number of operators; the first byte modulo 32 is an operator's stable id
// (ids from this count up select nothing yet: the input is skipped).
int fuzz_op_count();
// The name of choice `op` (for reports and docs).
const char* fuzz_op_name(int op);

// Decodes and checks one input; returns "" when every check passes, otherwise
// a description of the failure (the fuzzer aborts on it, the replay test
// reports it).
std::string check_fuzz_input(const uint8_t* data, size_t size);

}  // namespace fastattn::fuzz
