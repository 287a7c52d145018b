"""gluon_syncbn: synchronized BatchNorm for MXNet Gluon."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = ['tqdm', 'matplotlib', 'pillow']

setup(
    name='gluon_syncbn',
    version='0.1.0',
    description='Synchronized BatchNorm for MXNet Gluon: exact on any split, never hangs',
    long_description=open(os.path.join(HERE, 'README.md')).read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['gluon_syncbn', 'gluon_syncbn.*']),
    # The native operator's source: compiled at first import (gluon_syncbn/native).
    package_data={'gluon_syncbn': ['native/*.cc', 'native/*.h']},
    python_requires='>=3.7',
    # MXNet 1.9.1 uses np.bool, removed in NumPy 1.24.
    install_requires=['numpy<1.24'],
    extras_require={
        # Pick one MXNet build. The GPU wheel needs CUDA 11.2, cuDNN 8 and NCCL 2
        # libraries and an NVIDIA driver on the machine; it cannot import without them.
        'cpu': ['mxnet==1.9.1'],
        'gpu': ['mxnet-cu112==1.9.1'],
        # examples/segmentation: progress bar, figures, VOC images
        'examples': EXAMPLES,
        # the suite runs the example and the benchmarks' measurement helpers
        'test': ['pytest>=7', 'pytest-timeout>=2', 'psutil'] + EXAMPLES,
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'License :: OSI Approved :: Apache Software License',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    license='Apache-2.0',
)
