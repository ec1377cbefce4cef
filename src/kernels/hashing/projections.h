// Projections of rows on a few directions, register-blocked: the sign hash
// of clustered attention (hashing_cpu.cpp) and Reformer's LSH
// (reformer/reformer_cpu.cpp). The directions are packed transposed and
// padded to groups of up to four vectors, (E + 1) × B_pad, so that R rows
// accumulate a group of projections each at a time: eight independent FMA
// chains (four vectors for two rows, two for four, one for eight), every
// direction vector loaded once for all R rows, one broadcast of x[e] per row
// and step, starting from the offsets in row E.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/simd.h"

FASTATTN_ISA_BEGIN

// Projections of R rows x[0..R) on VG vectors of directions (the columns of
// w, row stride B_pad, offsets in row E); acc (R, B_pad) gets them.
template <typename T, int VG, int R>
void project_group(const T* const* x, int64_t E, const T* w, int64_t B_pad, T* acc) {
  using S = Simd<T>;
  using V = typename S::V;
  V a[R][VG];
  for (int v = 0; v < VG; ++v) {
    const V offset = S::load(w + E * B_pad + v * S::W);
    for (int r = 0; r < R; ++r) a[r][v] = offset;
  }
  for (int64_t e = 0; e < E; ++e) {
    V wv[VG];
    for (int v = 0; v < VG; ++v) {
      wv[v] = S::load(w + e * B_pad + v * S::W);
      // Kept in a register: GCC otherwise folds the load into each of the R
      // FMAs that use it, R loads per vector, and the loop waits on loads.
      if constexpr (S::W > 1) asm("" : "+v"(wv[v]));
    }
    for (int r = 0; r < R; ++r) {
      const V xe = S::set1(x[r][e]);
      for (int v = 0; v < VG; ++v) a[r][v] = S::fma(xe, wv[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VG; ++v) S::store(acc + r * B_pad + v * S::W, a[r][v]);
}

// B directions of E entries packed for project(), with offsets (zero
// unless set).
template <typename T>
class PackedDirections {
 public:
  PackedDirections(int64_t E, int64_t B) : E_(E), B_(B) {
    constexpr int64_t W = Simd<T>::W;
    // As many vectors per group as B needs, at most four.
    vg_ = std::max<int64_t>(1, std::min<int64_t>(4, (B + W - 1) / W));
    B_pad_ = std::max<int64_t>(1, (B + vg_ * W - 1) / (vg_ * W)) * (vg_ * W);
    pt_.assign(static_cast<size_t>((E + 1) * B_pad_), T(0));
  }
  // Entry e of direction b (e = E: its offset).
  void set(int64_t b, int64_t e, T value) { pt_[e * B_pad_ + b] = value; }
  // Rows projected at once (R): eight FMA chains.
  int rows() const { return vg_ == 1 ? 8 : vg_ == 2 ? 4 : 2; }
  // Row stride of the projections project() writes (>= B, the rest padding).
  int64_t stride() const { return B_pad_; }
  // acc (rows(), stride()): the projections of rows x[0 .. rows()).
  void project(const T* const* x, T* acc) const {
    const int64_t group = vg_ * Simd<T>::W;
    for (int64_t b0 = 0; b0 < B_pad_; b0 += group) {
      const T* w = pt_.data() + b0;
      switch (vg_) {
        case 1:
          project_group<T, 1, 8>(x, E_, w, B_pad_, acc + b0);
          break;
        case 2:
          project_group<T, 2, 4>(x, E_, w, B_pad_, acc + b0);
          break;
        case 3:
          project_group<T, 3, 2>(x, E_, w, B_pad_, acc + b0);
          break;
        default:
          project_group<T, 4, 2>(x, E_, w, B_pad_, acc + b0);
          break;
      }
    }
  }

 private:
  int64_t E_, B_, B_pad_, vg_;
  std::vector<T> pt_;
};

FASTATTN_ISA_END
