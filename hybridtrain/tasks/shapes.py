"""Built-in tasks on the procedural shapes set: 8,000 + 2,000 noisy 32x32 RGB images of 10 shape
classes generated locally from fixed seeds; harder than digits (thin outlines, textures, random
colours, a distractor blob). Accuracy on the 2,000 held-out images.
"""

from hybridtrain.tasks.builtin import task_function

smallcnn = task_function(__name__, "shapes", "smallcnn", "SmallCNN on shapes.")
widecnn = task_function(__name__, "shapes", "widecnn", "SmallCNN at width 192 on shapes.")
widemlp = task_function(__name__, "shapes", "widemlp", "The wide MLP on shapes.")
resnet18 = task_function(__name__, "shapes", "resnet18", "ResNet-18 (CIFAR stem) on shapes.")
resnet50 = task_function(__name__, "shapes", "resnet50", "ResNet-50 (CIFAR stem) on shapes.")
resnet152 = task_function(__name__, "shapes", "resnet152", "ResNet-152 (CIFAR stem) on shapes.")
