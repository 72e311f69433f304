"""Experiment tracking (the recipe's ``tracking:`` section): TensorBoard (default on), Weights & Biases, MLflow
and trackio, fed by the controller through one fan-out (``fanout.Trackers``) that turns a failing tracker off
after one warning. ``config`` is the recipe section, ``base`` the ``Tracker`` ABC, one module per backend."""

from gyre.services.control.outputs.tracking.base import Tracker, TrackerContext, TrackerUnavailable, flatten, metric_values
from gyre.services.control.outputs.tracking.config import TrackingConfig
from gyre.services.control.outputs.tracking.fanout import Trackers, open_trackers

__all__ = ["Tracker", "TrackerContext", "TrackerUnavailable", "TrackingConfig", "Trackers", "flatten",
           "metric_values", "open_trackers"]
