"""placeholder"""


def save_modelopt(model, path):
    raise NotImplementedError


def load_modelopt(model, path, mode="w4a16"):
    raise NotImplementedError
