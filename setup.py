"""gluon_syncbn: synchronized BatchNorm for MXNet Gluon."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# Every requirement carries this marker: on Python 3.12 and later the pip
# those Pythons ship (23.2.1 with 3.12.1, 24.2 with 3.13.0) would otherwise
# resolve NumPy < 1.24 first, build it from source and fail there ("No module
# named 'distutils'") instead of saying that this package needs another
# Python (python_requires below), which it says once nothing is left to build.
SUPPORTED = '; python_version < "3.12"'
EXAMPLES = ['tqdm', 'matplotlib', 'pillow']
# The CUDA 11 runtime libraries mxnet-cu112's libmxnet.so links against, one
# wheel each (each provides the soname it asks for); pinned to the versions
# CI imports the GPU wheel with.
CUDA_RUNTIME = [
    'nvidia-cuda-runtime-cu11==11.8.89',
    'nvidia-cublas-cu11==11.11.3.6',
    'nvidia-cufft-cu11==10.9.0.58',
    'nvidia-curand-cu11==10.3.0.86',
    'nvidia-cusolver-cu11==11.4.1.48',
    'nvidia-nvtx-cu11==11.8.86',
    'nvidia-nccl-cu11==2.21.5',
    'nvidia-cuda-nvrtc-cu11==11.8.89',
    'nvidia-cudnn-cu11==8.9.6.50',
]

setup(
    name='gluon_syncbn',
    version='0.1.0',
    description='Synchronized BatchNorm for MXNet Gluon: exact on any split, never hangs',
    long_description=open(os.path.join(HERE, 'README.md')).read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['gluon_syncbn', 'gluon_syncbn.*']),
    # The native library's source: compiled at a layer's first synchronized
    # call (gluon_syncbn/native).
    package_data={'gluon_syncbn': ['native/*.cc', 'native/*.h']},
    # MXNet 1.9.1 uses np.bool, removed in NumPy 1.24, and NumPy < 1.24 has
    # no wheels for Python 3.12 or later (its source build needs distutils,
    # gone in 3.12); MXNet 1.9.1 does not import with NumPy 1.26 either.
    python_requires='>=3.7, <3.12',
    install_requires=['numpy<1.24' + SUPPORTED],
    extras_require={name: [r + SUPPORTED for r in requirements] for name, requirements in {
        # Pick one MXNet build. The GPU wheel's libmxnet.so needs the CUDA 11
        # runtime libraries below (gluon_syncbn.cuda_libs preloads them) and the
        # NVIDIA driver's libcuda.so.1, which no wheel provides.
        'cpu': ['mxnet==1.9.1'],
        'gpu': ['mxnet-cu112==1.9.1'] + CUDA_RUNTIME,
        # examples/segmentation: progress bar, figures, VOC images
        'examples': EXAMPLES,
        # the suite runs the example and the benchmarks' measurement helpers
        'test': ['pytest>=7', 'pytest-timeout>=2', 'psutil'] + EXAMPLES,
    }.items()},
    classifiers=[
        'Programming Language :: Python :: 3',
        'License :: OSI Approved :: Apache Software License',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    license='Apache-2.0',
)
