# Relative imports that climb a level.
from ..common.train import train
from ..derived import model

train.output_dir = "output/child"
