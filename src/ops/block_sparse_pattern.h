// Pattern checks shared by the block_sparse_attention operator and its
// reference (internal).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastattn::ops {

// Validates a block-sparse pattern ("local" {window}, "strided" {stride,
// which}, "fixed" {stride, summary, which, per_head_summary}) for H heads;
// throws naming the parameter. Returns the kernels::SparsePattern.
int check_sparse_pattern(const char* op, const std::string& pattern,
                         const std::vector<int64_t>& params, int64_t H);

}  // namespace fastattn::ops
