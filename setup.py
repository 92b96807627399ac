from setuptools import find_packages, setup

setup(
    name="dschat",
    version="0.1.0",
    description="DeepSpeed-Chat fork: SFT, reward model and PPO for every common HF causal-LM "
                "family under every ZeRO stage, with its own ZeRO-3-correct generation engine",
    # inference/ and benchmarks/ too: their scripts import inference.common and benchmarks.*
    # as packages, so they run from any directory without sys.path edits
    packages=find_packages(include=["dschat", "dschat.*", "inference", "benchmarks", "applications", "applications.*"]),
    package_data={"dschat": ["assets/tokenizer/*", "assets/data/*"]},
    include_package_data=True,
    python_requires=">=3.9",
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
)
