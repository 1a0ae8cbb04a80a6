// A translation unit of the build (see nanovllm/kernels/cpu.py): every kernel file but
// quantized.cpp, compiled together so that torch's headers are parsed once for them all.
#include "../attention.cpp"
#include "../decoder_layer.cpp"
#include "../elementwise.cpp"
#include "../linear.cpp"
#include "../registration.cpp"
#include "../sampling.cpp"
#include "../thread_pool.cpp"
