"""Pixel accuracy and mean IoU from a confusion matrix (ignore label excluded)."""
import numpy as np


class SegmentationMetric(object):
    """Accumulates a ``num_classes x num_classes`` confusion matrix.

    Parameters
    ----------
    num_classes : int
    ignore_label : int
        Pixels with this label (and any label outside ``[0, num_classes)``,
        such as -1) are not counted.
    """

    def __init__(self, num_classes, ignore_label=255):
        self.num_classes = num_classes
        self.ignore_label = ignore_label
        self.reset()

    def reset(self):
        self.confusion = np.zeros((self.num_classes, self.num_classes), np.int64)

    def update(self, label, pred):
        """Add a batch: ``label`` and ``pred`` are integer arrays of equal shape."""
        label = np.asarray(label).astype(np.int64).ravel()
        pred = np.asarray(pred).astype(np.int64).ravel()
        keep = (label != self.ignore_label) & (label >= 0) & (label < self.num_classes)
        self.confusion += np.bincount(
            label[keep] * self.num_classes + pred[keep],
            minlength=self.num_classes ** 2).reshape(self.num_classes, self.num_classes)

    def get(self):
        """``(pixel accuracy, mean IoU)``; classes absent from labels and
        predictions do not count toward the mean.

        Raises
        ------
        ValueError
            If no labelled pixel was counted: there is no score to report.
        """
        c = self.confusion.astype(np.float64)
        total = c.sum()
        if not total:
            raise ValueError('no labelled pixel counted')
        union = c.sum(0) + c.sum(1) - np.diag(c)
        present = union > 0
        iou = np.diag(c)[present] / union[present]
        return float(np.trace(c) / total), float(iou.mean())
