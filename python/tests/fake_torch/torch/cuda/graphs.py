class CUDAGraph:
    def capture_begin(self, pool=None, capture_error_mode="global"):
        return "captured"
