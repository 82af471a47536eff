"""nn.Module drop-ins built on dropin.ops; inject_ puts them in place of torch modules."""
from .conv import Conv2d, ConvBNAct
from .linear import Linear
from .module import DropinModule, Folded
from .resnet import ResidualBlock
