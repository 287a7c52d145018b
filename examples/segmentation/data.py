"""Datasets for the segmentation example: synthetic shapes and Pascal VOC layout."""
import os

import numpy as np

IGNORE_LABEL = 255

# channel means/stds of ImageNet, as GluonCV normalizes
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SyntheticShapes(object):
    """Images with squares, discs and triangles on a textured background.

    Class 0 is background, 1 square, 2 disc, 3 triangle. Sample ``i`` is a
    deterministic function of ``(seed, i)``, generated on the fly; a thin band
    around every shape is labelled ``IGNORE_LABEL`` like VOC's object borders.

    Parameters
    ----------
    size : int
        Number of samples.
    crop_size : int
        Images are ``crop_size x crop_size``.
    seed : int
        Different seeds give disjoint-looking sets (train vs val).
    """

    num_classes = 4
    classes = ('background', 'square', 'disc', 'triangle')

    def __init__(self, size=256, crop_size=64, seed=0):
        self.size = size
        self.crop_size = crop_size
        self.seed = seed

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        rng = np.random.RandomState((self.seed * 1000003 + idx) % (2 ** 31))
        s = self.crop_size
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
        image = rng.uniform(0.3, 0.7, 3).astype(np.float32)[:, None, None] * np.ones((3, s, s), np.float32)
        image += 0.08 * np.sin(xx / rng.uniform(2, 6) + yy / rng.uniform(2, 6))[None]
        label = np.zeros((s, s), np.int32)
        for _ in range(rng.randint(1, 4)):
            cls = rng.randint(1, 4)
            r = rng.uniform(0.12, 0.25) * s
            cy, cx = rng.uniform(r, s - r, 2)
            if cls == 1:
                dist = np.maximum(np.abs(yy - cy), np.abs(xx - cx)) - r
            elif cls == 2:
                dist = np.hypot(yy - cy, xx - cx) - r
            else:  # triangle pointing up
                dist = np.maximum(yy - (cy + r), np.abs(xx - cx) * 1.7 - (yy - (cy - r)))
            color = rng.uniform(0, 1, 3).astype(np.float32)
            inside = dist < 0
            image[:, inside] = color[:, None] + rng.normal(0, 0.05, (3, int(inside.sum())))
            label[inside] = cls
            label[np.abs(dist) < 0.75] = IGNORE_LABEL
        image = (np.clip(image, 0, 1) - MEAN[:, None, None]) / STD[:, None, None]
        return image.astype(np.float32), label.astype(np.float32)


class VOCSegmentation(object):
    """Pascal VOC segmentation layout on disk.

    ``root/JPEGImages/<id>.jpg``, ``root/SegmentationClass/<id>.png`` (palette
    PNG, 255 = ignore) and ``root/ImageSets/Segmentation/<split>.txt``.
    Images are resized (labels with nearest neighbour) to a square crop.

    Parameters
    ----------
    root : str
        The VOC2012 folder.
    split : str
        'train', 'val' or any list file in ImageSets/Segmentation.
    crop_size : int

    Raises
    ------
    FileNotFoundError
        If the split's list file, or an image or label it lists, is missing.
    """

    num_classes = 21

    def __init__(self, root, split='train', crop_size=256):
        from PIL import Image  # noqa: F401  (fail early if Pillow is missing)
        layout = ('--data-root must be a VOC folder with JPEGImages/, SegmentationClass/ '
                  'and ImageSets/Segmentation/')
        list_file = os.path.join(root, 'ImageSets', 'Segmentation', split + '.txt')
        if not os.path.isfile(list_file):
            raise FileNotFoundError('no %s: %s' % (list_file, layout))
        with open(list_file) as f:
            self.ids = [line.strip() for line in f if line.strip()]
        self.root = root
        self.crop_size = crop_size
        # Checked here, not when a batch is read: a missing file would
        # otherwise stop training at the first epoch that draws it.
        for folder, ext in (('JPEGImages', '.jpg'), ('SegmentationClass', '.png')):
            missing = [name for name in self.ids
                       if not os.path.isfile(os.path.join(root, folder, name + ext))]
            if missing:
                raise FileNotFoundError(
                    '%d of the %d images in %s have no %s (first: %s): %s'
                    % (len(missing), len(self.ids), list_file,
                       os.path.join(root, folder, '<id>' + ext), missing[0], layout))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        from PIL import Image
        name = self.ids[idx]
        image = Image.open(os.path.join(self.root, 'JPEGImages', name + '.jpg')).convert('RGB')
        label = Image.open(os.path.join(self.root, 'SegmentationClass', name + '.png'))
        size = (self.crop_size, self.crop_size)
        image = np.asarray(image.resize(size, Image.BILINEAR), np.float32) / 255.0
        label = np.asarray(label.resize(size, Image.NEAREST), np.float32)
        image = ((image - MEAN) / STD).transpose(2, 0, 1)
        return image.astype(np.float32), label
