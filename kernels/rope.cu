// rope.cu — rotary position embedding, rotate-half (NeoX / HF Llama) convention.
//
// rope_rotate_half(x, positions, inv_freq, num_heads, head_dim, scale)
//   In place on x [rows][num_heads * head_dim] (f32). Row r is at position
//   positions[r]. For pair i in [0, head_dim/2):
//     angle    = float(pos) * inv_freq[i]   (f32, like HF; inv_freq carries the model's
//                                            RoPE scaling: llama3, linear, dynamic, yarn)
//     cos, sin of angle, each times scale  (YaRN's attention factor; 1 otherwise)
//     out[i]        = x[i] * cos - x[i+half] * sin
//     out[i + half] = x[i+half] * cos + x[i] * sin
//   (common.cuh's rope_pair.)
//   Launch: grid = (rows, num_heads), block = head_dim / 2 threads (threads
//   beyond head_dim/2 idle, so a block rounded up to a multiple of 32 is fine).
//   No shared memory. head_dim must be even.

extern "C" __global__ void rope_rotate_half(float* x, const unsigned* positions,
                                            const float* inv_freq, int num_heads, int head_dim,
                                            float scale) {
    const int half = head_dim >> 1;
    const int i = threadIdx.x;
    const int h = blockIdx.y;
    if (i >= half || h >= num_heads) return;
    const unsigned r = blockIdx.x;
    float* xh = x + ((unsigned long long)r * (unsigned long long)num_heads + (unsigned long long)h) *
                        (unsigned long long)head_dim;
    rope_pair(xh[i], xh[i + half], positions[r], inv_freq[i], scale, xh[i], xh[i + half]);
}
