// The attention kernels of float16, float8_e4m3fn and int8 KV caches: paged_attention.cc's
// templates instantiated for those types in an object of their own, which the build
// compiles beside paged_attention.cc's (declared there `extern template`).
#define JAXLLM_ATTENTION_MORE_TYPES
#include "paged_attention.cc"
