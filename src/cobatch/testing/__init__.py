"""What the tests and benchmarks build on and the server never imports: the writer of random-weight and
layer-cut GGUF files (`cobatch make-model`)."""
