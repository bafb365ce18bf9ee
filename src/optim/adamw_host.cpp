// adamw_update for large host buffers (see adamw_math.h): one AVX2 and one baseline clone of the
// same source, chosen by the loader (GCC target_clones), compiled at -O3 without math errno
// (CMakeLists.txt) so that the loop vectorises. Vectorising changes no bit: each element goes
// through the same IEEE operations, and neither clone contracts into fused multiply-adds.
#include "optim/adamw_math.h"

namespace qt {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
void adamw_update_host(float* w, const float* g, float* m, float* v, std::size_t n,
                       const AdamWStep& s, bool decays) {
  adamw_update(w, g, m, v, n, s, decays);
}

}  // namespace qt
