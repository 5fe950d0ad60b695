# safetensors tests (owned by the io work)
kt_add_test(test_io_safetensors LABELS io)
kt_add_test(test_out_file LABELS io)

# Cross-check against PyTorch's safetensors: the helper writes and checks files whose values
# follow a formula that tests/io/st_torch_roundtrip.py computes too. The script exits 77
# (skipped) where torch or safetensors is not installed.
add_executable(st_helper ${CMAKE_CURRENT_LIST_DIR}/st_helper.c)
target_link_libraries(st_helper PRIVATE kt)
if(EXISTS /usr/bin/python3)
  add_test(NAME io_torch_roundtrip
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/st_torch_roundtrip.py
                   $<TARGET_FILE:st_helper>)
  set_tests_properties(io_torch_roundtrip PROPERTIES SKIP_RETURN_CODE 77 LABELS io TIMEOUT 300)
endif()

# Sharded checkpoints (index.json), converting reads, kt_session_load from them.
kt_add_test(test_io_sharded LABELS io)
target_compile_definitions(test_io_sharded PRIVATE KT_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
# Loading N bytes of parameters costs about N bytes of peak RSS (VmHWM), not 2N.
kt_add_test(test_io_load_rss LABELS io)
