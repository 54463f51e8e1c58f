from .broken_part import value
