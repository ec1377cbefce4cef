# fastattn — the two commands of a fresh machine:
#   make demo   install what is missing, build, run the demo
#   make test   install what is missing, build, run every test (C++ and Python)
# Also: make test-pip (pip torch 2.x venv), make check-cuda-build (CUDA operators against pip's torch, no GPU), make bench, make build, make test-asan, make test-asan-ci, make fuzz, make format, make install, make clean,
#       make approx (pretrained MiniLM approximated by other attention types; docs/approx.md).

BUILD      ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
PREFIX     ?= /usr/local
# Threads for the tests (the machine's cores by default).
export OMP_NUM_THREADS ?= $(shell nproc)

.PHONY: all deps configure build demo test test-pip pip-env check-cuda-build bench approx test-asan test-asan-ci gpu-session fuzz fuzz-merge format install check-install clean

all: build

deps:
	@bash scripts/install_deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	$(BUILD)/fastattn demo

test: build
	cd $(BUILD) && ctest --output-on-failure -j 1
	$(MAKE) test-pip

# The Python users' route: a virtual environment (.venv) with the newest
# PyTorch 2.x from PyPI (wheels cached in ~/.cache/fastattn/wheels), fastattn
# pip-installed into it, and the Python suite (operators, opcheck,
# torch.compile) run there (scripts/pip_env.sh). PIP_CUDA=1 builds the CUDA
# operators too (needs nvcc; much longer); AUTO builds them when torch has CUDA
# and nvcc is found.
PIP_CUDA ?= 0
pip-env: deps
	FASTATTN_CUDA=$(PIP_CUDA) bash scripts/pip_env.sh
test-pip: deps
	FASTATTN_CUDA=$(PIP_CUDA) bash scripts/pip_env.sh --test

# The CUDA operators built against pip's CUDA torch (docs/cuda.md): configures
# build-cuda-pip with FASTATTN_CUDA=ON against the torch of the venv (.venv,
# scripts/pip_env.sh; PIP_TORCH_DIR overrides) and builds every CUDA kernel,
# every src/ops/cuda registration and the library, for TORCH_CUDA_ARCH_LIST
# (default 9.0 alone: the whole list of torch's architectures takes several
# times as long). Needs nvcc, no GPU. CHECK_CUDA_TARGETS="fastattn
# fastattn_tests" builds the tests too (tests/cuda/ included).
VENV_PYTHON          ?= $(or $(FASTATTN_VENV),.venv)/bin/python
PIP_TORCH_DIR        ?= $(shell $(VENV_PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path + "/Torch")' 2>/dev/null)
TORCH_CUDA_ARCH_LIST ?= 9.0
CHECK_CUDA_TARGETS   ?= fastattn
check-cuda-build:
	@torch_dir='$(PIP_TORCH_DIR)'; \
	if [ -z "$$torch_dir" ]; then \
	  echo "check-cuda-build: no torch in $(VENV_PYTHON) (make pip-env, or set PIP_TORCH_DIR)"; exit 1; fi; \
	set -x; \
	cmake -S . -B build-cuda-pip -DTorch_DIR="$$torch_dir" -DFASTATTN_CUDA=ON \
	  -DTORCH_CUDA_ARCH_LIST='$(TORCH_CUDA_ARCH_LIST)' -DFASTATTN_BUILD_BENCH=OFF -DFASTATTN_BUILD_CLI=OFF \
	  $(CMAKE_ARGS) && \
	cmake --build build-cuda-pip -j $(JOBS) --target $(CHECK_CUDA_TARGETS)

bench: build
	$(BUILD)/bench_full_attention

# all-MiniLM-L6-v2 with full attention and with approximations, no fine-tuning
# (docs/approx.md): fetches the model and the Debian descriptions, writes
# $(BUILD)/approx.json and the plot $(BUILD)/approx.png.
APPROX_PASSAGES ?= 300
approx: build
	bash scripts/fetch_minilm.sh
	$(BUILD)/fastattn approx --passages $(APPROX_PASSAGES) --json $(BUILD)/approx.json
	@/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || apt-get install -y python3-matplotlib
	/usr/bin/python3 scripts/plot_approx.py $(BUILD)/approx.json $(BUILD)/approx.png

# AddressSanitizer + UndefinedBehaviorSanitizer debug build of the C++ suite
# and of the emulated CUDA kernels (every test; ASAN_GTEST_FILTER and
# ASAN_EMU_FILTER narrow them). UBSan halts on the first report.
# Leak checks stay off: LibTorch's and OpenMP's process-lifetime allocations
# would drown ours.
ASAN_GTEST_FILTER ?= *
ASAN_EMU_FILTER   ?= *
test-asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFASTATTN_SANITIZE=ON -DFASTATTN_BUILD_BENCH=OFF $(CMAKE_ARGS)
	cmake --build build-asan -j $(JOBS) --target fastattn_tests \
	  $$(grep -q '^fastattn_cuda_emu_tests:' build-asan/Makefile && echo fastattn_cuda_emu_tests)
	cd build-asan && ASAN_OPTIONS=detect_leaks=0:new_delete_type_mismatch=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ./fastattn_tests --gtest_filter='$(ASAN_GTEST_FILTER)'
	cd build-asan && if [ -x fastattn_cuda_emu_tests ]; then \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ./fastattn_cuda_emu_tests --gtest_brief=1 --gtest_filter='$(ASAN_EMU_FILTER)'; fi

# On a machine with an NVIDIA GPU and a CUDA build of PyTorch: the CUDA tests,
# the CUDA opcheck and nn tests, the GPU benchmarks and an Nsight Compute
# profile, with binaries prepared on this machine by
# `scripts/gpu_session.sh --prepare-build PYTHON` or built there
# (scripts/gpu_session.sh, docs/cuda.md "On a GPU machine").
gpu-session:
	bash scripts/gpu_session.sh

# The sanitizer subset CI runs (.ci/run; the whole of test-asan took ~1100 s
# to run after a ~1000 s build on 2 cores, too much next to the rest of CI):
# the robustness tests (bad-input table, edge numerics, fuzz corpus replay and
# seeded fuzz inputs) and every operator's own suite (harness: float64
# references, gradients, finite differences, awkward shapes), plus masks and
# the registry; of the emulated CUDA kernels (~570 s whole) about 90 s: every
# kernel family at least once, every dtype, the emulator's own checks.
ASAN_CI_FILTER ?= Validation*:OutputCache*:ClusterMembers*:RowDots*:EdgeNumerics*:FuzzCorpus*:*FullAttention*:Clustered.ReadsAndWritesRowLayoutsInPlace:*CausalLinearProduct*:*EluLinearAttention*:EluFeatureMap*:*HardRetrievalOp*:ClusteredTopkAttention*:ClusterCodes*:HashQueries*:GatherTokens*:*ReformerOp*:ReformerHash*:*SparseAttention*:SparsePatterns*:Mask*:Registry*:AttentionInputs*:*DenseAttention*:AttentionDropout*
ASAN_CI_EMU_FILTER ?= CudaEmulator*:CudaEmuMma*:CudaEmuBlockSparseLimits*:CudaEmuEluFeatureMap*:CudaEmuHardRetrievalRng*:FullAttentionCudaEmuArch*:FullAttentionCudaEmu/*.UnvectorisableLoads:FullAttentionCudaEmu/*.KeyLengthsAndEmptyRows:FullAttentionCudaEmu/*.Causal:FullAttentionCudaEmu/*.GradLseAndAccumulate:Patterns/CudaEmuBlockSparse.Float16/*:Patterns/CudaEmuBlockSparse.BFloat16/*:Modes/CudaEmuHardRetrieval.Float16/*:Modes/CudaEmuHardRetrieval.BFloat16/*:ClusteredEmuTokenGather*:ClusteredEmuTopk.ClusterMeansAndCentroidGrads:ClusteredEmuClusterCodes.MatchesCpuRandomAndPrototypes:ClusteredEmuTopk.PlainBFloat16:ClusteredEmuHashQueries.Float16:CudaEmuCausalProduct.EmptyValues:CudaEmuCausalProduct.Float16:CudaEmuEluLinearAttention.EmptySides:CudaEmuEluLinearAttention.FullBFloat16:ReformerCudaEmu.LshHashOneBucket:ReformerCudaEmu.HeadDimensionLimitIsAnError:ReformerCudaEmu.AttentionFloat16
test-asan-ci:
	$(MAKE) test-asan ASAN_GTEST_FILTER='$(ASAN_CI_FILTER)' ASAN_EMU_FILTER='$(ASAN_CI_EMU_FILTER)'

# libFuzzer over every operator (fuzz/, docs/reliability.md): clang build of the
# library with ASan + UBSan and coverage, then FUZZ_TIME seconds of fuzzing
# starting from the committed corpus fuzz/corpus (new inputs go to
# build-fuzz/corpus; `make fuzz-merge` adds the ones with new coverage to
# fuzz/corpus, which the replay test FuzzCorpus.* runs in `make test`).
FUZZ_TIME ?= 300
FUZZ_ARGS ?=
FUZZ_ENV = ASAN_OPTIONS=detect_leaks=0:new_delete_type_mismatch=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_NUM_THREADS=1
build-fuzz/fuzz_ops: FORCE
	@bash scripts/install_deps.sh --fuzz
	CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFASTATTN_FUZZ=ON -DFASTATTN_BUILD_TESTS=OFF -DFASTATTN_BUILD_BENCH=OFF
	cmake --build build-fuzz -j $(JOBS) --target fuzz_ops
fuzz: build-fuzz/fuzz_ops
	mkdir -p build-fuzz/corpus
	$(FUZZ_ENV) build-fuzz/fuzz_ops -max_total_time=$(FUZZ_TIME) -max_len=1024 -timeout=30 \
	  -rss_limit_mb=4096 $(FUZZ_ARGS) build-fuzz/corpus fuzz/corpus
fuzz-merge: build-fuzz/fuzz_ops
	$(FUZZ_ENV) build-fuzz/fuzz_ops -merge=1 fuzz/corpus build-fuzz/corpus
FORCE:

format:
	git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# Installs into a scratch prefix and builds examples/find_package against it,
# as a user's project would (find_package(fastattn)).
check-install: build
	rm -rf $(BUILD)/check-install
	cmake --install $(BUILD) --prefix $(BUILD)/check-install/prefix
	cmake -S examples/find_package -B $(BUILD)/check-install/build \
	  -DCMAKE_PREFIX_PATH=$(CURDIR)/$(BUILD)/check-install/prefix $(CMAKE_ARGS)
	cmake --build $(BUILD)/check-install/build -j $(JOBS)
	LD_LIBRARY_PATH=$(CURDIR)/$(BUILD)/check-install/prefix/lib $(BUILD)/check-install/build/readme_example

clean:
	rm -rf $(BUILD) build-asan build-fuzz build-cuda-pip
