# Sourced by scripts/test: the C++ suite under sanitizers (scripts/test --sanitize), CUDA off.
#   build-asan/  every C++ test with AddressSanitizer + UndefinedBehaviorSanitizer
#   build-tsan/  ThreadSanitizer for the tests whose code runs threads: the publisher (its
#                background upload thread) and subscriber (parallel fetches), the store and
#                transport (run_parallel), and the CPU engine and compact codec (the thread
#                pool's parallel_for)
# Expects ROOT; ASAN_BUILD_DIR / TSAN_BUILD_DIR override the folders.
# Not run by plain scripts/test (CI): on the shared 2-core development machine at -j1 the ASan
# build took 24 min (its 224 tests 68 s) and the TSan build 7 min (its tests 2.6 min), which
# with the fuzzing step would not fit CI's 40 minutes reliably.
TSAN_TESTS=(test_parallel test_publisher test_protocol test_store_folder test_http_transport test_cpu_engine test_compact_codec)

sanitizer_build() {
  local dir=$1 sanitize=$2 jobs=$3
  shift 3
  echo "== configuring $dir (-fsanitize=$sanitize, CUDA off)"
  # -O1 with line tables: readable reports, and quicker to build than the suite's -O3.
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1 -DNDEBUG" \
    -DCMAKE_C_FLAGS_RELEASE="-O1 -g1 -DNDEBUG" -DDELTASYNC_ENABLE_CUDA=OFF \
    -DDELTASYNC_BUILD_BENCHMARKS=OFF -DDELTASYNC_SANITIZE="$sanitize" >/dev/null
  echo "== building $dir ($jobs jobs)"
  cmake --build "$dir" -j "$jobs" "$@"
}

run_sanitizer_suites() {
  local jobs=$1 t0=$SECONDS
  local asan_dir=${ASAN_BUILD_DIR:-$ROOT/build-asan} tsan_dir=${TSAN_BUILD_DIR:-$ROOT/build-tsan}
  # A finding fails its test: ASan/UBSan abort on the first report, TSan exits 66.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
  sanitizer_build "$asan_dir" address,undefined "$jobs"
  echo "== C++ tests under ASan + UBSan"
  ctest --test-dir "$asan_dir" --output-on-failure -j "$jobs" --timeout 900
  local asan_s=$((SECONDS - t0))
  local targets=()
  for t in "${TSAN_TESTS[@]}"; do targets+=(--target "$t"); done
  sanitizer_build "$tsan_dir" thread "$jobs" "${targets[@]}"
  echo "== C++ tests under TSan: ${TSAN_TESTS[*]}"
  # Each binary directly: CTest would list the tests not built here as failures.
  for t in "${TSAN_TESTS[@]}"; do
    echo "-- $t"
    "$tsan_dir/tests/$t" --gtest_brief=1
  done
  echo "== sanitizer suites clean: ASan+UBSan ${asan_s} s, TSan $((SECONDS - t0 - asan_s)) s (builds included)"
}
