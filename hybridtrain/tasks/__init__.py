"""Built-in tasks: the models and data sets hybridtrain ships, as ordinary task modules.

`digits`, `shapes` and `synthetic` (throughput only) each offer smallcnn, widecnn, widemlp,
resnet18, resnet50 and resnet152, e.g. `hybridtrain.tasks.digits:smallcnn`. Importing this
package imports nothing else (the control plane reads task names without torch).
"""
