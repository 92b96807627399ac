"""Shared pytest configuration."""


def pytest_configure(config):
    # GPU-only tests: @pytest.mark.gpu plus a skipif(not torch.cuda.is_available())
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
