// Measurement helpers shared by `fastattn bench` and `fastattn demo`: running
// one case in a forked child, peak-memory probing, medians.
//
// Peak memory, honestly: LibTorch 1.13 exposes no CPU allocator statistics, so
// we measure resident memory. Each case runs in its own forked child (a fresh
// address space that earlier cases cannot pollute). After the warm-up and the
// timed runs the child calls malloc_trim(0) (freed heap pages go back to the
// kernel), resets the kernel's high-water mark (`echo 5 >
// /proc/self/clear_refs`, Linux >= 4.0), reads VmRSS as the baseline, runs the
// call once more and reads VmHWM. peak growth = VmHWM - baseline: the memory
// one call touches beyond its inputs and the warm runtime state (outputs,
// temporaries, saved tensors for backward), page-granular.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fastattn::cli {

// Runs `fn` in a forked child and returns the JSON it produced. If `fn`
// throws, returns {"error": message}; if the child dies (e.g. killed for
// memory), {"error": "child ... killed by signal N"}. The parent must not have
// run a parallel region before forking (libgomp's thread pool does not survive
// fork): callers do all tensor work inside `fn`.
nlohmann::json run_in_child(const std::function<nlohmann::json()>& fn);

// Resets the resident high-water mark and returns the baseline RSS in bytes,
// or nullopt where /proc/self/clear_refs cannot be written.
std::optional<int64_t> reset_peak_rss();
// VmHWM in bytes (nullopt when /proc/self/status is unreadable).
std::optional<int64_t> peak_rss();
// Runs `fn` once and returns the growth of the resident high-water mark it
// caused, in bytes (nullopt when the kernel does not let us reset it).
std::optional<int64_t> measure_peak_growth(const std::function<void()>& fn);

// Runs `fn` `warmup` times untimed, then `repeat` times timed; returns the
// times in milliseconds.
std::vector<double> time_ms(const std::function<void()>& fn, int64_t repeat, int64_t warmup = 1);
// Runs `a` and `b` once each untimed, then `repeat` times each in turn (a
// first, then b first, ...): two programs timed in the same minutes, whose
// ratio a busy machine moves less than it moves either time alone.
std::pair<std::vector<double>, std::vector<double>> alternated_ms(const std::function<void()>& a,
                                                                  const std::function<void()>& b,
                                                                  int64_t repeat);
double median(std::vector<double> xs);

std::string format_bytes(double bytes);            // "12.0 MiB"
std::string format_fixed(double x, int decimals);  // "3.14"

}  // namespace fastattn::cli
