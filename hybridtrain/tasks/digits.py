"""Built-in tasks on scikit-learn's digits: 1,797 real 8x8 handwritten digits shipped inside
scikit-learn (no download), a fixed stratified 80/20 split, accuracy on the held-out 20%.

    hybridtrain train --task hybridtrain.tasks.digits:smallcnn --task-args '{"lr": 0.05}' ...
"""

from hybridtrain.tasks.builtin import task_function

smallcnn = task_function(__name__, "digits", "smallcnn", "SmallCNN (~26k parameters) on digits.")
widecnn = task_function(__name__, "digits", "widecnn",
                        "SmallCNN at width 192 (3.35M parameters) on digits: the testbed benchmark's "
                        "communication-bound model.")
widemlp = task_function(__name__, "digits", "widemlp", "A 25M-parameter MLP on digits (communication-bound).")
resnet18 = task_function(__name__, "digits", "resnet18", "ResNet-18 (CIFAR stem) on digits.")
resnet50 = task_function(__name__, "digits", "resnet50", "ResNet-50 (CIFAR stem) on digits.")
resnet152 = task_function(__name__, "digits", "resnet152", "ResNet-152 (CIFAR stem) on digits.")
