// A translation unit of the build (see nanovllm/kernels/cpu.py): GGUF's block formats, the
// longest file to compile, on its own so that the two units build side by side on two cores, and
// the mixture-of-experts kernel that calls its kernels.
#include "../quantized.cpp"
#include "../moe.cpp"
