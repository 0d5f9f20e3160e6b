"""The paper's subject-verb agreement task: data, model, distilled student, Tables 1-2.

* :mod:`~attnflow_lab.agreement.agreement`: a seeded generator of English-like
  subject-verb agreement data (NumPy only), a stand-in for Linzen et al. (2016).
* :mod:`~attnflow_lab.agreement.agreement_linzen`: the same grammar with the data set's
  statistics matched.
* :mod:`~attnflow_lab.agreement.agreement_torch`: the paper's model, its training, saving
  and loading without pickle.
* :mod:`~attnflow_lab.agreement.agreement_distill`: the student the paper's code
  distilled from an LSTM teacher.
* :mod:`~attnflow_lab.agreement.reproduction`: the paper's Tables 1-2.
"""

__all__: list[str] = []
