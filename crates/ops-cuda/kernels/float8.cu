// fp8 training's quantize and the code transpose its GEMMs need, for compute_80 (every GPU from
// the A100 on): the bodies are float8.cuh's; float8_sm89.cu builds the same for compute_89.

#include "float8.cuh"
