"""Built-in tasks on synthetic data, FOR THROUGHPUT ONLY: 4,096 Gaussian-noise 3x32x32 images
with random labels, so loss and accuracy mean nothing (the held-out set is the first 256
training samples). Use them to measure samples/s and communication, never to compare accuracy.
"""

from hybridtrain.tasks.builtin import task_function

smallcnn = task_function(__name__, "synthetic", "smallcnn", "SmallCNN on noise (throughput only).")
widecnn = task_function(__name__, "synthetic", "widecnn", "SmallCNN at width 192 on noise (throughput only).")
widemlp = task_function(__name__, "synthetic", "widemlp", "The wide MLP on noise (throughput only).")
resnet18 = task_function(__name__, "synthetic", "resnet18", "ResNet-18 on noise (throughput only).")
resnet50 = task_function(__name__, "synthetic", "resnet50", "ResNet-50 on noise (throughput only).")
resnet152 = task_function(__name__, "synthetic", "resnet152", "ResNet-152 on noise (throughput only).")
