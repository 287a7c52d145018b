"""A small FCN with an atrous (dilated) head on a model-zoo ResNet backbone."""
from mxnet import gluon
from mxnet.gluon.model_zoo import vision


class AtrousHead(gluon.HybridBlock):
    """Parallel 1x1 and dilated 3x3 branches (an ASPP-lite), fused by a 1x1 conv.

    Parameters
    ----------
    channels : int
        Width of each branch.
    num_classes : int
    norm_layer : Block class
        ``gluon.nn.BatchNorm`` or ``gluon_syncbn.SyncBatchNorm``.
    norm_kwargs : dict or None
    """

    def __init__(self, channels, num_classes, norm_layer=gluon.nn.BatchNorm, norm_kwargs=None,
                 **kwargs):
        super(AtrousHead, self).__init__(**kwargs)
        norm_kwargs = norm_kwargs or {}

        def branch(kernel, dilation):
            seq = gluon.nn.HybridSequential()
            seq.add(gluon.nn.Conv2D(channels, kernel, padding=dilation if kernel == 3 else 0,
                                    dilation=dilation, use_bias=False),
                    norm_layer(**norm_kwargs), gluon.nn.Activation('relu'))
            return seq
        with self.name_scope():
            self.b1 = branch(1, 1)
            self.b2 = branch(3, 2)
            self.b3 = branch(3, 4)
            self.project = gluon.nn.HybridSequential()
            self.project.add(gluon.nn.Conv2D(channels, 1, use_bias=False),
                             norm_layer(**norm_kwargs), gluon.nn.Activation('relu'),
                             gluon.nn.Dropout(0.1), gluon.nn.Conv2D(num_classes, 1))

    def hybrid_forward(self, F, x):
        return self.project(F.concat(self.b1(x), self.b2(x), self.b3(x), dim=1))


class FCN(gluon.HybridBlock):
    """ResNet-18 stages 1-2 (stride 8) + atrous head, upsampled to the input size.

    With ``aux=True`` a second head on stage 1 gives an auxiliary output.
    The backbone comes from ``mxnet.gluon.model_zoo`` (random init, or the
    ``pretrained`` parameter file); its BatchNorm layers follow ``norm_layer``
    through :func:`gluon_syncbn.convert_model`.
    """

    def __init__(self, num_classes, norm_layer=gluon.nn.BatchNorm, norm_kwargs=None,
                 aux=False, pretrained=None, **kwargs):
        super(FCN, self).__init__(**kwargs)
        resnet = vision.resnet18_v1()
        if pretrained:
            resnet.load_parameters(pretrained, allow_missing=False, ignore_extra=True)
        if norm_layer is not gluon.nn.BatchNorm:
            from gluon_syncbn import convert_model
            convert_model(resnet, **(norm_kwargs or {}))
        self.aux = aux
        with self.name_scope():
            features = list(resnet.features)
            self.stem = gluon.nn.HybridSequential()
            self.stem.add(*features[:5])         # conv, bn, relu, maxpool, stage1 (stride 4)
            self.stage2 = features[5]            # stride 8, 128 channels
            self.head = AtrousHead(64, num_classes, norm_layer, norm_kwargs)
            if aux:
                self.aux_head = gluon.nn.HybridSequential()
                self.aux_head.add(gluon.nn.Conv2D(32, 3, padding=1, use_bias=False),
                                  norm_layer(**(norm_kwargs or {})), gluon.nn.Activation('relu'),
                                  gluon.nn.Conv2D(num_classes, 1))

    def hybrid_forward(self, F, x):
        c1 = self.stem(x)
        out = F.contrib.BilinearResize2D(self.head(self.stage2(c1)), like=x, mode='like')
        if self.aux:
            return out, F.contrib.BilinearResize2D(self.aux_head(c1), like=x, mode='like')
        return out
